"""`torch.compile(parallel)` takes a rank's whole program: one graph, no graph break,
forward and backward compiled with torch's functional collectives in them (what
inductor buckets and overlaps), outputs and every gradient equal to eager. On 2 gloo
ranks (mesh 1×1×2, features split over c): the smallest job whose programs still run
all-gathers (the layer norm's statistics among them), reduce-scatters, all-reduces
and a gradient bucket; inductor compiles are slow on 2 cores, so it runs on the MLP
only. The MLP runs again with every layer's input kept as its stored shard and
gathered again in backward (the regather knob: `autoshard.runtime.ops.keep_shard`)."""

from pathlib import Path

import torch

import autoshard
from autoshard.errors import InputError
from autoshard.mesh import Mesh
from autoshard.planning.collectives import share_collectives
from autoshard.planning.planner import Knobs, plan_graph
from autoshard.planning.units import units_of
from autoshard.runtime.ranks import shared_pool
from autoshard.testing import load_factory
from autoshard.tracing.trace import trace

EXAMPLES = Path(__file__).parents[1] / "examples"
CASES = [  # (factory, its sizes, backends, inputs kept as shards)
    (f"{EXAMPLES}/mlp.py:mlp", {"layers": 1, "dropout": 0.0}, ("aot_eager", "inductor"), False),
    (f"{EXAMPLES}/gpt.py:gpt", {}, ("aot_eager",), False),
    (f"{EXAMPLES}/mlp.py:mlp", {"layers": 1, "dropout": 0.0}, ("aot_eager",), True),
]


def _parallel(model, inputs, device_mesh, regather: bool):
    """The model under "3d"; with `regather`, every layer keeps its input's shard."""
    if not regather:
        return autoshard.parallelize(model, device_mesh, inputs, strategy="3d")
    traced = trace(model, inputs)
    mesh = Mesh.from_shape(tuple(device_mesh.shape))
    base = plan_graph(traced, mesh, "3d")
    layers = [n for n, p in base.nodes.items() if p.strategy.split_weight is not None]
    plan = plan_graph(traced, mesh, "3d", knobs=dict.fromkeys(layers, Knobs(regather=True)))
    plan = share_collectives(traced, plan, units_of(traced, plan))
    return autoshard.parallelize(model, device_mesh, inputs, plan=plan)


def _step(module, inputs, parallel):
    """One forward and backward: the output and every local gradient."""
    out = module(*inputs)
    (out if out.dim() == 0 else out.square().mean()).backward()
    grads = {name: p.grad for name, p in parallel.named_parameters()}
    parallel.zero_grad(set_to_none=True)
    return out.detach(), grads


def _differ(got: torch.Tensor, want: torch.Tensor) -> bool:
    # atol: a gradient that is zero in exact arithmetic (a key's bias under softmax)
    # is rounding noise in both, far below every real gradient here
    return not torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def _aot_eager(collectives: dict[str, set[str]]):
    """The "aot_eager" backend, recording the functional collectives of the forward and
    the backward graph it is given in `collectives`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def recorder(pass_: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            functional = {t for t in targets if t.startswith("_c10d_functional.")}
            collectives.setdefault(pass_, set()).update(functional)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))


def _compile_cases(device_mesh) -> list[tuple]:
    from torch._dynamo.utils import counters

    results = []
    for spec, sizes, backends, regather in CASES:
        torch.manual_seed(0)
        model, inputs = load_factory(spec)(**sizes)
        parallel = _parallel(model, inputs, device_mesh, regather)
        with autoshard.comm_log() as log:
            want, want_grads = _step(parallel, inputs, parallel)
        kinds = {r.kind for r in log.records} | {
            "bucket" for r in log.records if r.node.startswith("grad_bucket")
        }
        if "ops_keep_shard(" in parallel.code:
            kinds.add("keep_shard")
        for backend in backends:
            torch._dynamo.reset()
            counters.clear()
            collectives = {}
            compiler = _aot_eager(collectives) if backend == "aot_eager" else backend
            compiled = torch.compile(parallel, backend=compiler)
            got, grads = _step(compiled, inputs, parallel)
            differ = [n for n, g in want_grads.items() if _differ(grads[n], g)]
            differ += ["output"] if _differ(got, want) else []
            results.append(
                (
                    Path(spec).name + (" keeping shards" if regather else ""),
                    backend,
                    dict(counters["graph_break"]),
                    counters["stats"]["unique_graphs"],
                    differ,
                    kinds,
                    collectives,
                )
            )
            if backend == "aot_eager":  # the input checks still refuse a smaller batch
                try:
                    compiled(*[x[:1] for x in inputs])
                except InputError:
                    collectives["refused"] = True
    return results


def test_torch_compile_takes_the_whole_program_and_equals_eager():
    for ranks in shared_pool(2).run(_compile_cases, (1, 1, 2)):
        assert len(ranks) == 4
        assert "keep_shard" in ranks[-1][5], "the knob kept no input as a shard"
        for model, backend, breaks, graphs, differ, kinds, collectives in ranks:
            case = f"{model} under {backend}"
            assert breaks == {}, f"{case}: graph breaks {breaks}"
            assert graphs == 1, f"{case}: {graphs} graphs"
            assert differ == [], f"{case}: differs from eager in {differ}"
            assert kinds >= {"all_gather", "reduce_scatter", "all_reduce", "bucket"}, case
            if backend == "aot_eager":  # the graphs hold functional collectives, and waits
                gathers = "_c10d_functional.all_gather_into_tensor.default"
                scatters = "_c10d_functional.reduce_scatter_tensor.default"
                reduces = "_c10d_functional.all_reduce.default"
                waits = "_c10d_functional.wait_tensor.default"
                assert collectives["forward"] >= {gathers, scatters, waits}, case
                assert collectives["backward"] >= {gathers, scatters, reduces, waits}, case
                assert collectives.get("refused"), f"{case}: a smaller batch was not refused"
