"""Layouts as DTensors, and distributed checkpoints that reshard: saved on one mesh
under one plan, resumed on another mesh under another plan, or in one plain
process, and the other way round."""

import copy
import itertools
from pathlib import Path

import pytest
import torch
from torch import fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

import autoshard
from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.testing import load_factory
from autoshard.tracing.trace import trace

EXAMPLES = Path(__file__).parents[1] / "examples"
GPT, LLAMA = f"{EXAMPLES / 'gpt.py'}:gpt", f"{EXAMPLES / 'llama.py'}:llama"


@pytest.mark.parametrize("sizes", [(2, 2, 2), (1, 2, 4), (2, 3, 4)])
def test_placements_describe_every_nesting_exactly(sizes):
    mesh = Mesh.from_shape(sizes)
    for order in itertools.permutations(mesh.names):
        for cut, end in itertools.combinations_with_replacement(range(4), 2):
            layout = Layout((order[:cut], order[cut:end]))
            for coord in itertools.product(*map(range, sizes)):
                want = layout.shard_slices((48, 24), mesh, dict(zip(mesh.names, coord)))
                size, offset = _compute_local_shape_and_global_offset(
                    (48, 24), sizes, list(coord), layout.placements(mesh)
                )
                assert [(o, o + s) for o, s in zip(offset, size)] == want, (layout, coord)


def _program_values(parallel, inputs) -> dict[str, torch.Tensor]:
    """Every node's local value in one run of the rank's program."""
    values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            values[node.name] = out = super().run_node(node)
            return out

    Recorder(parallel.program).run(*inputs)
    return {n.name: values[n.name] for n in parallel.program.graph.nodes if n.name in values}


def _stored_value(program: fx.GraphModule, values: dict, name: str) -> torch.Tensor:
    """The value of plan node `name` as stored: after its own output collectives."""
    nodes = {n.name: n for n in program.graph.nodes}
    last = nodes[name]
    while True:
        chain = [
            u for u in last.users if u.meta.get("autoshard_serves") == name and u.args[0] is last
        ]
        if not chain:
            return values[last.name]
        last = chain[0]


def _case(factory, strategy, mesh_shape):
    """`factory`'s program compiled under `strategy`, and the value of every node of its
    serial trace: made here, once, for every rank."""
    torch.manual_seed(0)
    model, inputs = load_factory(factory)()
    serial_values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            serial_values[node.name] = out = super().run_node(node)
            return out

    Recorder(trace(copy.deepcopy(model), inputs).graph_module).run(*inputs)
    compiled = autoshard.compile(model, mesh_shape, inputs, strategy=strategy)
    return factory, compiled, serial_values


def _round_trips(mesh, factory, compiled, serial_values):
    """Names of the parameters and activations whose DTensor is not the serial tensor."""
    torch.manual_seed(0)
    model, inputs = load_factory(factory)()
    parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
    device_mesh, plan = parallel._mesh.device_mesh, parallel.plan

    def full(local, layout):
        placements = layout.placements(plan.mesh)[: device_mesh.ndim]
        return DTensor.from_local(local, device_mesh, placements, run_check=False).full_tensor()

    wrong, checked = [], 0
    serial_state = model.state_dict()
    for fqn, local in parallel.local_state_dict().items():
        layout = plan.storage.get(fqn) or Layout.replicated(local.ndim)
        checked += 1
        if not torch.equal(full(local, layout), serial_state[fqn]):
            wrong.append(fqn)
    values = _program_values(parallel, inputs)
    for name, placed in plan.nodes.items():
        want = serial_values.get(name)
        if not isinstance(want, torch.Tensor) or placed.strategy.outputs:
            continue
        checked += 1
        got = full(_stored_value(parallel.program, values, name), placed.strategy.stored)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            wrong.append(name)
    return wrong, checked


def _all_round_trips(mesh, cases):
    return [_round_trips(mesh, *case) for case in cases]


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 2, 4)])
def test_every_layout_is_an_exact_dtensor(rank_pool, mesh):
    cases = [_case(GPT, "3d", mesh), _case(LLAMA, "3d-allreduce", mesh)]
    for rank, results in enumerate(rank_pool.run(_all_round_trips, mesh, cases)):
        for wrong, checked in results:
            assert checked > 80 and not wrong, (rank, wrong)


def _loss(out) -> torch.Tensor:
    return out if out.ndim == 0 else out.sum()


def _steps(module, optimizer, inputs, steps, first):
    for step in range(first, first + steps):
        torch.manual_seed(100 + step)
        _loss(module(*inputs)).backward()
        if isinstance(module, autoshard.ParallelModule):
            autoshard.clip_grad_norm_(module, 0.5)
        else:
            torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _compiled(factory, mesh_shape, **planning) -> autoshard.Compiled:
    torch.manual_seed(0)
    model, inputs = load_factory(factory)()
    return autoshard.compile(model, mesh_shape, inputs, **planning)


def _save_parallel(mesh, factory, path, compiled):
    torch.manual_seed(0)
    model, inputs = load_factory(factory)()
    parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
    optimizer = _adamw(parallel.parameters())
    _steps(parallel, optimizer, inputs, 3, 0)
    autoshard.checkpoint.save(parallel, path, optimizer)


def _resume_parallel(mesh, factory, path, compiled):
    """3 more steps after loading `path` into a freshly initialized program (other seed)."""
    torch.manual_seed(0)
    _, inputs = load_factory(factory)()
    torch.manual_seed(1)  # the loaded state, not the initialization, must count
    model, _ = load_factory(factory)()
    parallel = autoshard.parallelize(model, mesh, inputs, compiled=compiled)
    optimizer = _adamw(parallel.parameters())
    autoshard.checkpoint.load(parallel, path, optimizer)
    _steps(parallel, optimizer, inputs, 3, 3)
    return parallel.full_state_dict(rank0_only=True), parallel.plan.to_json()


def _serial(factory, steps, dtype=torch.float32):
    torch.manual_seed(0)
    model, inputs = load_factory(factory)()
    model = model.to(dtype)
    optimizer = _adamw(model.parameters())
    _steps(model, optimizer, inputs, steps, 0)
    return model, optimizer, inputs


def _close(got: dict, factory, steps):
    """Every tensor of `got` within fp32's own rounding of the serial run, judged against
    fp64. AdamW divides each gradient by its own running RMS, so the rounding noise of a
    near-zero gradient moves its weight by a fraction of the learning rate whatever the
    weight's size: the noise scale is the serial fp32 run's largest error over the whole
    state (a wrong or misplaced optimizer state moves weights by the learning rate)."""
    serial = _serial(factory, steps)[0].state_dict()
    exact = _serial(factory, steps, torch.float64)[0].state_dict()
    noise = max((serial[name].double() - want).abs().max().item() for name, want in exact.items())
    for name, want in exact.items():
        err = (got[name].double() - want).abs().max().item()
        assert err <= 10 * noise, (name, err, noise)


def test_a_checkpoint_resumes_on_another_mesh_under_another_plan(rank_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    rank_pool.run(_save_parallel, (2, 2, 2), GPT, path, _compiled(GPT, (2, 2, 2), strategy="3d"))
    solved = _compiled(GPT, (1, 2, 4))
    exported, _ = rank_pool.run(_resume_parallel, (1, 2, 4), GPT, path, solved)[0]
    _close(exported, GPT, 6)

    # the same checkpoint in one plain process, with its plain optimizer
    model, optimizer, inputs = _serial(GPT, 0)
    autoshard.checkpoint.load(model, path, optimizer)
    assert optimizer.state[next(model.parameters())]["step"].item() == 3
    _close(model.state_dict(), GPT, 3)

    # and a serial checkpoint starts a parallel run
    serial_path = str(tmp_path / "serial")
    model, optimizer, _ = _serial(GPT, 3)
    autoshard.checkpoint.save(model, serial_path, optimizer)
    compiled = _compiled(GPT, (2, 2, 2), strategy="3d")
    exported, _ = rank_pool.run(_resume_parallel, (2, 2, 2), GPT, serial_path, compiled)[0]
    _close(exported, GPT, 6)


def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path):
    model, optimizer, _ = _serial(GPT, 1)
    with pytest.raises(autoshard.CheckpointError, match="no checkpoint at"):
        autoshard.checkpoint.load(model, tmp_path / "nowhere")
    llama_path = tmp_path / "llama"
    autoshard.checkpoint.save(_serial(LLAMA, 0)[0], llama_path)
    with pytest.raises(autoshard.CheckpointError, match="lacks .* tensors this module has"):
        autoshard.checkpoint.load(model, llama_path)
    wider = tmp_path / "wider"
    torch.manual_seed(0)
    other, _ = load_factory(f"{EXAMPLES / 'gpt.py'}:gpt")()
    with torch.no_grad():
        other.blocks[0].attn.q.weight = torch.nn.Parameter(torch.zeros(40, 32))
    autoshard.checkpoint.save(other, wider)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(autoshard.CheckpointError, match=r"q.weight' has shape \[40, 32\]"):
        autoshard.checkpoint.load(model, wider)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # untouched
