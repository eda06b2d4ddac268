"""Train a LLaMA-architecture Hugging Face model tensor-parallel, from meta to checkpoint.

    torchrun --standalone --nproc-per-node 8 examples/train.py --mesh 2x2x2 --steps 20
    torchrun --standalone --nproc-per-node 8 examples/train.py --mesh 1x2x4 \\
        --resume runs/ckpt/step-20 --steps 40            # resume on another mesh shape
    python examples/train.py --steps 40                  # the same run serially, one process

The model is built on the meta device (no rank ever holds it whole), planned by
the solver under --budget bytes per rank, then filled: from a Hugging Face
``save_pretrained`` directory (--hf, each rank reading its slices) or by
`init_weights`, which gives exactly what the serial model's construction gives
under --seed. AdamW with linear warmup and cosine decay, gradient clipping over
the shards, an optional pure-bf16 mode. A checkpoint every --save-every steps
(`autoshard.checkpoint.save`) resumes on any mesh and plan, or in one process.

The data is a generated English-like text, tokenized by bytes; the batch of
step s depends only on s and --seed, so a resumed run sees what an uninterrupted
one would. Without torchrun it trains the plain model serially (the reference
curve); --curve writes the losses as JSON.
"""

import argparse
import json
import math
import os
import random
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import autoshard
from autoshard.sizes import parse_bytes


class LanguageModel(nn.Module):
    """The Hugging Face model as `parallelize` takes it: tensors in, the loss out."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.model = LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels, use_cache=False).loss


def corpus(sentences: int = 4000) -> torch.Tensor:
    """A generated English-like text (the same on every machine, nothing downloaded)
    as bytes: vocabulary 256."""
    rng = random.Random(0)
    words = {
        "noun": "model rank mesh tensor shard plan graph layer gradient step".split(),
        "verb": "splits gathers trains saves loads reduces plans holds moves".split(),
        "adj": "small large sharded replicated partial serial parallel exact".split(),
    }

    def pick(kind: str) -> str:
        return rng.choice(words[kind])

    text = " ".join(
        f"the {pick('adj')} {pick('noun')} {pick('verb')} the {pick('adj')} {pick('noun')}."
        for _ in range(sentences)
    )
    return torch.tensor(list(text.encode()), dtype=torch.long)


def batch(data: torch.Tensor, step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s full global batch (the same on every rank, any resume)."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=generator)
    rows = torch.stack([data[s : s + args.seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]  # Hugging Face shifts labels itself: give ids twice


def learning_rate(step: int, args) -> float:
    """Linear warmup to --lr, then cosine decay to --min-lr at --total-steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.total_steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def memory_text(device: torch.device) -> str:
    """This rank's memory: allocated on the GPU, or resident on the host (current/peak)."""
    if device.type == "cuda":
        return f"{torch.cuda.memory_allocated(device) / 2**20:.0f} MiB"
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    rss = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    return f"{rss:.0f}/{peak:.0f} MiB"


def build(args, device):
    """(the module to train, whether it is parallel): parallelized on meta under
    torchrun, the plain model built for real otherwise."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.dim,
        intermediate_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        bos_token_id=0,
        eos_token_id=0,
    )
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if not dist.is_initialized():
        torch.manual_seed(args.seed)
        model = LanguageModel(config).to(dtype)
        if args.hf:
            autoshard.checkpoint.load_hf(model, args.hf, prefix="model.")
        return model
    shape = tuple(int(s) for s in args.mesh.split("x"))
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("a", "b", "c")[: len(shape)])
    with torch.device("meta"):
        model = LanguageModel(config).to(dtype)
        # two tensors: the same one twice would be traced as one input
        ids, labels = (torch.zeros(args.batch, args.seq, dtype=torch.long) for _ in range(2))
    budget = parse_bytes(args.budget) if args.budget else None
    parallel = autoshard.parallelize(model, mesh, (ids, labels), memory_budget=budget)
    if args.hf:
        autoshard.checkpoint.load_hf(parallel, args.hf, prefix="model.")
    elif not args.resume:
        parallel.init_weights(seed=args.seed)
    return parallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--mesh", default="2x2x2", help="mesh shape under torchrun, e.g. 2x2x2 or 1x2x4")
    add("--budget", default=None, help="memory per rank for the solver, e.g. 64MiB")
    add("--dim", type=int, default=64, help="hidden size")
    add("--hidden", type=int, default=256, help="MLP size")
    add("--layers", type=int, default=2)
    add("--heads", type=int, default=4)
    add("--kv-heads", type=int, default=2)
    add("--seq", type=int, default=32)
    add("--batch", type=int, default=8, help="global batch (every rank feeds all of it)")
    add("--steps", type=int, default=20, help="train until this step")
    add("--total-steps", type=int, default=None, help="the schedule's length (--steps)")
    add("--lr", type=float, default=3e-3)
    add("--min-lr", type=float, default=3e-4)
    add("--warmup", type=int, default=4)
    add("--clip", type=float, default=1.0, help="max global gradient norm")
    add("--weight-decay", type=float, default=0.1)
    add("--bf16", action="store_true", help="parameters, gradients and AdamW state in bf16")
    add("--seed", type=int, default=0)
    add("--hf", default=None, help="a save_pretrained directory to start from")
    add("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    add("--ckpt-dir", default="runs/ckpt")
    add("--resume", default=None, help="a checkpoint directory, from any mesh or serial")
    add("--curve", default=None, help="write the losses by step as JSON here")
    args = parser.parse_args()
    args.total_steps = args.total_steps or args.steps

    parallel_run = "WORLD_SIZE" in os.environ
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if parallel_run:
        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(device)
    lead = not parallel_run or dist.get_rank() == 0

    module = build(args, device)
    optimizer = torch.optim.AdamW(
        module.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    first = 0
    if args.resume:
        autoshard.checkpoint.load(module, args.resume, optimizer)
        first = json.loads((Path(args.resume) / "train.json").read_text())["step"]
    data = corpus()
    losses: dict[int, float] = {}
    where = f"mesh {args.mesh}" if parallel_run else "serial"
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("loss {task.fields[loss]}  {task.fields[speed]} tok/s  mem {task.fields[mem]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not lead) as progress:
        task = progress.add_task(
            where, total=args.steps, completed=first, loss="-", speed="-", mem="-"
        )
        for step in range(first, args.steps):
            started = time.perf_counter()
            ids, labels = batch(data, step, args)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args)
            loss = module(ids.to(device), labels.to(device))
            loss.backward()
            if parallel_run:
                autoshard.clip_grad_norm_(module, args.clip)
            else:
                torch.nn.utils.clip_grad_norm_(module.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[step] = loss.item()
            speed = args.batch * args.seq / (time.perf_counter() - started)
            progress.update(
                task,
                advance=1,
                loss=f"{losses[step]:.4f}",
                speed=f"{speed:,.0f}",
                mem=memory_text(device),
            )
            if args.save_every and (step + 1) % args.save_every == 0:
                path = Path(args.ckpt_dir) / f"step-{step + 1}"
                autoshard.checkpoint.save(module, path, optimizer)
                if lead:
                    (path / "train.json").write_text(json.dumps({"step": step + 1}))
                    progress.console.print(f"saved {path}")
    if lead and args.curve:
        Path(args.curve).parent.mkdir(parents=True, exist_ok=True)
        Path(args.curve).write_text(json.dumps({"where": where, "losses": losses}))
    if parallel_run:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
