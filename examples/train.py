"""Train the MLP example tensor-parallel, with the serial loss printed beside it.

    torchrun --standalone --nproc-per-node 8 examples/train.py --steps 5

gloo on CPU, NCCL where CUDA is present. Every rank feeds the full batch and
gets the full output back; rank 0 also trains a serial copy from the same
seed and prints both losses, which agree to float rounding.
"""

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autoshard

sys.path.insert(0, str(Path(__file__).parent))
from mlp import mlp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mesh", default="2x2x2", help="mesh shape, e.g. 2x2x2 or 1x2x4")
    parser.add_argument("--strategy", default="3d", choices=("3d", "3d-allreduce", "replicated"))
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    shape = tuple(int(s) for s in args.mesh.split("x"))
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("a", "b", "c")[: len(shape)])

    torch.manual_seed(0)
    model, (x,) = mlp()
    target = torch.randn_like(x)
    serial = copy.deepcopy(model).to(device) if rank == 0 else None
    parallel = autoshard.parallelize(model, mesh, (x,), strategy=args.strategy).to(device)
    x, target = x.to(device), target.to(device)
    optimizer = torch.optim.SGD(parallel.parameters(), lr=args.lr)
    serial_optimizer = torch.optim.SGD(serial.parameters(), lr=args.lr) if serial else None

    if rank == 0:
        local = sum(p.numel() for p in parallel.parameters())
        total = sum(p.numel() for p in model.parameters())
        print(
            f"mesh {args.mesh}, strategy {args.strategy}: rank 0 holds {local}/{total} parameters"
        )
        print(f"{'step':>4}  {'parallel loss':>14}  {'serial loss':>14}")
    for step in range(args.steps):
        torch.manual_seed(step)  # the same dropout masks in both programs
        loss = torch.nn.functional.mse_loss(parallel(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if serial:
            torch.manual_seed(step)
            serial_loss = torch.nn.functional.mse_loss(serial(x), target)
            serial_optimizer.zero_grad()
            serial_loss.backward()
            serial_optimizer.step()
            print(f"{step:>4}  {loss.item():>14.8f}  {serial_loss.item():>14.8f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
