"""Plans at real scale: LLaMA-3 8B/70B/405B and GPT-3 175B on 64 to 4096 devices.

    python benchmarks/scale.py            # the whole table (long: every model, mesh, batch)
    python benchmarks/scale.py --quick    # LLaMA-3 70B, 64 x 4096 tokens, 8x8x8 only
    python benchmarks/scale.py --models llama3-70b --meshes 8x8x8 --seqs 4096 --tokens 1
    python benchmarks/scale.py --planning 3   # the acceptance case's planning against export

Models are Hugging Face configurations built on the meta device (no weights), in
fp32, trained with Adam, on ib-cluster (nodes of 8 H100 over InfiniBand; the mesh's
last axis inside a node). Per row:

- export s: `torch.export` alone; trace s: autoshard's trace (export included);
  plan s: the solver's planning after the trace (`SOLVED`: the default "3d" space
  in every order of the axes, and Megatron-LM and data parallel per block part; the
  cost model, HiGHS, the final plan and its cost), budget 80 GiB;
- smallest: the smallest per-rank budget any plan of that space fits, and
  floor, the closed form `floor_bytes` below, with their ratio;
- at 80 GiB: the solved plan's predicted peak, step time, model FLOPs utilization
  (6·N·T + 12·L·H·S·T FLOPs a step over the devices' fp32 peak), the families it
  chose and the fraction of block parts it recomputes;
- uniform ×: the step time of the plan users would pick by hand, all-3D with every
  block recomputed, over the solved plan's (above 1: the solver is faster), both as
  the solver prices them: without the gradient reductions that overlap hides, which
  the step time column leaves out;
- megatron ×: the same for Megatron-LM, tensor parallel over the mesh's last (NVLink)
  axis and data parallel over the others, with the recomputation and weight storage
  the solver finds best for it at 80 GiB, or "no fit" where no such plan fits.

`--planning N` times, N times in turn, `torch.export`, autoshard's trace and
`autoshard.plan`'s planning after it (the default space, budget 80 GiB) on the quick
case, and prints their minimum and median and the ratios to export.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from autoshard.api import plan_traced
from autoshard.cost.hardware import Hardware
from autoshard.errors import BudgetError
from autoshard.mesh import Mesh
from autoshard.planning.options import PlanOptions
from autoshard.planning.solver import (
    SPACES,
    Option,
    Problem,
    build_problem,
    plan_choice,
    smallest_peak,
    solve,
)
from autoshard.planning.units import in_block
from autoshard.tracing.trace import trace

GiB = 2**30
SOLVED = (*SPACES["3d"], "megatron", "dp")  # the uniform plans below are in it
BUDGET = 80 * GiB
ADAM_FP32 = 16  # bytes per parameter: fp32 weight, gradient, exp_avg, exp_avg_sq


@dataclass(frozen=True)
class Config:
    """A decoder-only transformer's sizes."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated: bool  # LLaMA's SwiGLU MLP (gate, up, down), else GPT's (fc, gelu, proj)


CONFIGS = {
    c.name: c
    for c in (
        Config("llama3-8b", 32, 4096, 32, 8, 14336, 128256, True),
        Config("llama3-70b", 80, 8192, 64, 8, 28672, 128256, True),
        Config("llama3-405b", 126, 16384, 128, 8, 53248, 128256, True),
        # GPT-3's vocabulary of 50257 padded to a multiple of 64, as Megatron does.
        Config("gpt3-175b", 96, 12288, 96, 96, 49152, 50304, False),
    )
}
MESHES = ("4x4x4", "8x8x8", "8x8x16", "16x16x16")
SEQS = (4096, 8192)
TOKENS_M = (1, 2, 4)  # global batch, millions of tokens (2^20)


class CausalLM(nn.Module):
    """Takes ids and labels, returns the loss: the training step autoshard plans."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels, use_cache=False).loss


def build(config: Config, seq: int) -> nn.Module:
    if config.gated:
        hf = LlamaConfig(
            vocab_size=config.vocab,
            hidden_size=config.hidden,
            intermediate_size=config.intermediate,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            num_key_value_heads=config.kv_heads,
            max_position_embeddings=seq,
            bos_token_id=0,
            eos_token_id=0,
        )
        return CausalLM(LlamaForCausalLM(hf))
    hf = GPT2Config(
        vocab_size=config.vocab,
        n_positions=seq,
        n_embd=config.hidden,
        n_layer=config.layers,
        n_head=config.heads,
        n_inner=config.intermediate,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return CausalLM(GPT2LMHeadModel(hf))


def meta_model(name: str, layers: int | None = None, batch: int = 64, seq: int = 4096):
    """Configuration `name` (with `layers` instead of its own depth) built on the meta
    device, with `batch` sequences of `seq` token ids and labels, also on meta."""
    config = CONFIGS[name]
    if layers is not None:
        config = dataclasses.replace(config, layers=layers)
    with torch.device("meta"):
        model = build(config, seq)
        ids = torch.randint(0, config.vocab, (batch, seq))
        labels = torch.randint(0, config.vocab, (batch, seq))
    return model, (ids, labels)


def layer_saved_per_token(config: Config) -> int:
    """Elements autograd keeps per token for one layer's backward (its replay, when
    recomputed): attention keeps its norm's input, the projections' input, q, k, v
    before and after the rotary embedding, attention's q, k, v (k, v repeated to
    every head) and output, and the output projection's input (about 9·H + 3·Hkv);
    a gated MLP its norm's and projections' input, gate, up, their activation and
    product (2·H + 4·I), GPT's MLP its norm's and fc's input, fc's output and the
    activation (2·H + 2·I)."""
    h, i = config.hidden, config.intermediate
    kv = config.hidden * config.kv_heads // config.heads
    attention = 9 * h + 3 * kv
    return attention + (2 * h + 4 * i if config.gated else 2 * h + 2 * i)


def floor_bytes(config: Config, params: int, tokens: int, devices: int) -> float:
    """The closed-form floor of one rank's peak: everything split over all devices,
    every layer recomputed. Parameters with their gradient and Adam's state (16 B
    each), every layer's input (kept for its replay), one layer's activations
    replayed, and the logits' log-softmax kept for the loss (fp32)."""
    layer_inputs = config.layers * tokens * config.hidden * 4
    replay = tokens * layer_saved_per_token(config) * 4
    logits = tokens * config.vocab * 4
    return (params * ADAM_FP32 + layer_inputs + replay + logits) / devices


def model_flops(config: Config, params: int, tokens: int, seq: int) -> float:
    """FLOPs of one training step: 6 per parameter and token (forward and backward of
    every matrix product; the input embedding's lookup is no product) and attention's
    12·L·H·S per token (Chowdhery et al. 2022)."""
    matrix_params = params - config.vocab * config.hidden * (1 if config.gated else 0)
    return 6 * matrix_params * tokens + 12 * config.layers * config.hidden * seq * tokens


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def uniform_3d_recomputed(problem: Problem) -> tuple[float, float]:
    """All-3D with every block part recomputed, the plan users would pick by hand: its
    step time and peak as the solver prices them (its options are in `problem`)."""
    choice = {u: Option("3d", checkpoint=in_block(u)) for u in problem.units}
    return problem.evaluate(choice)


def megatron_cell(solved: Problem, solved_step: float) -> str:
    """The best Megatron-LM plan at `BUDGET`, its step time over the solved plan's;
    or, where none fits, the smallest budget one would need. The solved problem holds
    Megatron-LM's options for every unit: restricted to them, it is the problem built
    for "megatron" alone."""
    problem = solved.restricted(("megatron",))
    try:
        choice = solve(problem, BUDGET)
    except BudgetError:
        return f"no fit (needs {smallest_peak(problem) / GiB:.0f} GiB)"
    return f"{problem.evaluate(choice)[0] / solved_step:.2f}"


def row(config: Config, seq: int, tokens_m: float, shape: str, hardware: Hardware) -> list[str]:
    mesh = Mesh.from_shape(tuple(int(s) for s in shape.split("x")))
    tokens = int(tokens_m * 2**20)
    model, inputs = meta_model(config.name, config.layers, tokens // seq, seq)
    _, export_s = timed(torch.export.export, model, inputs, strict=False)
    traced, trace_s = timed(trace, model, inputs)
    params = sum(t.numel() for t in traced.parameters.values() if t.requires_grad)
    devices = math.prod(mesh.sizes)
    start = time.perf_counter()
    problem = build_problem(traced, mesh, hardware, SOLVED, 2.0)
    cells = [config.name, str(seq), f"{tokens_m:g}M", shape]
    cells += [f"{export_s:.1f}", f"{trace_s:.1f}"]
    try:
        choice = solve(problem, BUDGET)
    except BudgetError as e:  # the model does not fit 80 GiB on this mesh
        plan_s = time.perf_counter() - start
        floor = floor_bytes(config, params, tokens, devices)
        smallest = smallest_peak(problem)
        return cells + [
            f"{plan_s:.1f}",
            f"{smallest / GiB:.1f}",
            f"{floor / GiB:.1f}",
            f"{smallest / floor:.2f}",
            f"no fit ({type(e).__name__})",
            "",
            "",
            "",
            "",
            "",
            "",
        ]
    plan = plan_choice(traced, mesh, problem, choice, hardware, 2.0)
    plan_s = time.perf_counter() - start
    smallest = smallest_peak(problem)
    floor = floor_bytes(config, params, tokens, devices)
    cost = plan.cost
    mfu = model_flops(config, params, tokens, seq) / (
        cost.step_time * devices * hardware.peak(torch.float32)
    )
    families = ", ".join(sorted({option.family for option in choice.values()}))
    blocks = [o for u, o in choice.items() if in_block(u)]
    recomputed = sum(o.checkpoint for o in blocks) / max(len(blocks), 1)
    # the plans compared as the solver prices them: overlap, which the emitted plan's
    # step time leaves out (`Cost.overlapped`), differs from plan to plan and is not priced
    solved_step = problem.evaluate(choice)[0]
    uniform_step, uniform_peak = uniform_3d_recomputed(problem)
    fits = "" if uniform_peak <= BUDGET else " (over budget)"
    return cells + [
        f"{plan_s:.1f}",
        f"{smallest / GiB:.1f}",
        f"{floor / GiB:.1f}",
        f"{smallest / floor:.2f}",
        f"{cost.peak_memory / GiB:.1f}",
        f"{cost.step_time:.2f}",
        f"{100 * mfu:.0f}%",
        families,
        f"{100 * recomputed:.0f}%",
        f"{uniform_step / solved_step:.2f}{fits}",
        megatron_cell(problem, solved_step),
    ]


COLUMNS = (
    "model",
    "seq",
    "tokens",
    "mesh",
    "export s",
    "trace s",
    "plan s",
    "smallest GiB",
    "floor GiB",
    "smallest/floor",
    "peak GiB @80",
    "step s",
    "MFU",
    "families",
    "recomputed",
    "uniform ×",
    "megatron ×",
)


def planning_time(repeats: int, console: Console) -> None:
    """Export, trace and plan the quick case in turn, `repeats` times (see above)."""
    model, inputs = meta_model("llama3-70b", batch=64, seq=4096)
    mesh = Mesh.from_shape((8, 8, 8))
    options = PlanOptions.from_user(memory_budget=BUDGET, hardware="ib-cluster")
    seconds: dict[str, list[float]] = {"export": [], "trace": [], "plan": []}
    for _ in range(repeats):  # each from a collected heap: no phase pays for another's garbage
        gc.collect()
        seconds["export"].append(timed(torch.export.export, model, inputs, strict=False)[1])
        gc.collect()
        traced, trace_s = timed(trace, model, inputs)
        seconds["trace"].append(trace_s)
        gc.collect()
        seconds["plan"].append(timed(plan_traced, traced, mesh, options)[1])
        del traced
    table = Table(title=f"LLaMA-3 70B, 64 × 4096 tokens, 8x8x8 ib-cluster: {repeats} runs each")
    for column in ("", "min s", "median s", "min / export", "median / export"):
        table.add_column(column, justify="right")
    low, mid = min(seconds["export"]), statistics.median(seconds["export"])
    for name, times in seconds.items():
        a, b = min(times), statistics.median(times)
        table.add_row(name, f"{a:.2f}", f"{b:.2f}", f"{a / low:.2f}", f"{b / mid:.2f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="LLaMA-3 70B, 64×4096, 8x8x8")
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--meshes", nargs="+", default=list(MESHES))
    parser.add_argument("--seqs", nargs="+", type=int, default=list(SEQS))
    parser.add_argument("--tokens", nargs="+", type=float, default=list(TOKENS_M))
    parser.add_argument("--planning", type=int, metavar="N", help="time planning, N runs")
    args = parser.parse_args()
    if args.quick:  # the acceptance case: 64 sequences of 4096 tokens
        args.models, args.meshes, args.seqs, args.tokens = ["llama3-70b"], ["8x8x8"], [4096], [0.25]
    warnings.filterwarnings("ignore")  # fallbacks to another family are in the plan
    hardware = Hardware.load("ib-cluster")
    # a file or a pipe gets the whole table, not one squeezed to 80 columns
    console = Console(width=None if sys.stdout.isatty() else 220)
    if args.planning is not None:
        if args.planning < 1:
            parser.error("--planning needs a number of runs, 1 or more")
        return planning_time(args.planning, console)
    table = Table(title="Plans at scale (ib-cluster, fp32 + Adam, meta device, budget 80 GiB)")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for name in args.models:
        for seq in args.seqs:
            for tokens_m in args.tokens:
                for shape in args.meshes:
                    cells = row(CONFIGS[name], seq, tokens_m, shape, hardware)
                    table.add_row(*cells)
                    console.print(" ".join(cells))  # progress: the table comes at the end
    console.print(table)


if __name__ == "__main__":
    main()
