"""Each rank's peak resident memory while a model it could not hold whole is built on
meta, parallelized, loaded from Hugging Face safetensors and trained one step.

    python benchmarks/memory.py                 # 8 gloo ranks on this machine
    python benchmarks/memory.py --layers 8 --dim 1024

The model is N times one rank's share of it (N = 8 ranks). Every rank's peak
resident set (VmHWM, reset after the imports and the process group are up) is
printed against the bound

    model / N  +  the largest single tensor  +  a fixed overhead (--overhead)

for parallelize + load_hf, and for one forward, backward and SGD step, which
adds this rank's share of the gradients (another model / N) and the step's
activations (--activations). The step runs the plan the solver makes for a
budget of exactly that: 2 · model / N + the activations allowance, so that
it keeps no more than the allowance of what it gathers (under plain "3d" each
layer would keep its gathered weight, model / 4 in all on 2x2x2). The plan's
own predicted peak is printed beside what the rank measured.

The ranks run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_, 128 KiB
unless set): otherwise glibc raises it to the size of each large tensor freed, and
later tensors of up to 32 MiB come from a heap that keeps freed memory, so the
resident peak stops following the live tensors (at 448 MiB it measured 333-464
MiB per rank for a step planned at 176 MiB; 206 MiB with the threshold fixed).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

MIB = 2**20


def resident_peak() -> int:
    """This process's peak resident set since the last `reset_peak`, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=3 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
        bos_token_id=0,
        eos_token_id=0,
    )


def rank_main(rank: int, args, directory: str, port: int, budget: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from train import LanguageModel

    import autoshard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    mesh = init_device_mesh("cpu", (2, 2, args.ranks // 4), mesh_dim_names=("a", "b", "c"))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    dist.barrier()
    reset_peak()
    baseline = resident_peak()
    with torch.device("meta"):
        model = LanguageModel(config(args))
        meta_inputs = (torch.zeros_like(ids, device="meta"), torch.zeros_like(ids, device="meta"))
    parallel = autoshard.parallelize(
        model, mesh, meta_inputs, memory_budget=budget, optimizer="sgd"
    )
    autoshard.checkpoint.load_hf(parallel, directory, prefix="model.")
    loaded = resident_peak()
    optimizer = torch.optim.SGD(parallel.parameters(), lr=1e-3)
    parallel(ids, ids).backward()
    optimizer.step()
    stepped = resident_peak()
    share = sum(p.numel() * p.element_size() for p in parallel.parameters())
    records = [None] * args.ranks
    record = (baseline, loaded - baseline, stepped - baseline, share)
    dist.all_gather_object(records, record)
    if rank == 0:
        report(args, records, directory, budget, parallel.plan.cost.peak_memory)
    dist.destroy_process_group()


def report(args, records, directory, budget: int, predicted: float) -> None:
    from safetensors import safe_open

    sizes = []
    for path in Path(directory).glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                sizes.append(_nbytes(piece))
    model, largest = sum(sizes), max(sizes)
    overhead = args.overhead * MIB
    bound_load = model / args.ranks + largest + overhead
    bound_step = 2 * model / args.ranks + largest + overhead + args.activations * MIB
    table = Table(
        title=f"peak resident memory per rank, model {model / MIB:.0f} MiB on {args.ranks} ranks"
    )
    for column in (
        "rank",
        "baseline",
        "parallelize + load_hf",
        "bound",
        "+ one step",
        "predicted",
        "bound",
        "own shards",
    ):
        table.add_column(column, justify="right")
    ok = True
    for rank, (baseline, loaded, stepped, share) in enumerate(records):
        ok &= loaded <= bound_load and stepped <= bound_step
        table.add_row(
            str(rank),
            f"{baseline / MIB:.0f} MiB",
            f"{loaded / MIB:.1f} MiB",
            f"{bound_load / MIB:.1f} MiB",
            f"{stepped / MIB:.1f} MiB",
            f"{predicted / MIB:.1f} MiB",
            f"{bound_step / MIB:.1f} MiB",
            f"{share / MIB:.1f} MiB",
        )
    console = Console()
    console.print(table)
    console.print(
        f"model {model / MIB:.1f} MiB, 1/N {model / args.ranks / MIB:.1f} MiB, largest tensor "
        f"{largest / MIB:.1f} MiB, fixed overhead {args.overhead} MiB (tracing, planning, "
        f"the program), activations allowance {args.activations} MiB, step planned for "
        f"{budget / MIB:.1f} MiB, MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}: "
        + ("every rank within its bound" if ok else "[red]a rank exceeds its bound[/red]")
    )


def _nbytes(piece) -> int:
    itemsize = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}[piece.get_dtype()]
    count = 1
    for size in piece.get_shape():
        count *= size
    return count * itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--overhead", type=int, default=64, help="fixed overhead, MiB")
    parser.add_argument("--activations", type=int, default=64, help="a step's activations, MiB")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))  # read as the ranks start

    from train import LanguageModel

    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        serial = LanguageModel(config(args))
        serial.model.save_pretrained(directory, max_shard_size="64MB")
        model = sum(p.numel() * p.element_size() for p in serial.parameters())
        budget = 2 * model // args.ranks + args.activations * MIB
        del serial
        port = 29500 + os.getpid() % 1000
        mp.spawn(rank_main, (args, directory, port, budget), nprocs=args.ranks)


if __name__ == "__main__":
    main()
