"""The `autoshard show` command: plan, summary, program and shards, errors (no processes)."""

import dataclasses
import re
from pathlib import Path

import pytest

from autoshard.cli import main, parse_mesh, rank_coordinate, slice_text
from autoshard.layout import Layout
from autoshard.mesh import Mesh
from autoshard.strategies import entries

MLP = str(Path(__file__).parents[1] / "examples/mlp.py")


def show(capsys, *args: str) -> str:
    assert main(["show", f"{MLP}:mlp", *args]) == 0
    return capsys.readouterr().out


def plan_section(out: str) -> str:
    """The plan table: from its title to the communication summary."""
    return out[out.index("plan") : out.index("predicted communication")]


def holds(out: str, parameter: str) -> str:
    line = next(l for l in out.splitlines() if l.strip().startswith(parameter + " "))
    return line.split()[-1] if "," not in line else line[line.index("rows") :].strip()


def test_show_3d(capsys):
    out = show(capsys, "--mesh", "2x2x2", "--strategy", "3d")
    assert "MLP" in out and "2×2×2" in out
    plan = plan_section(out)
    for node in ("layer_norm", "linear", "linear_1", "gelu", "add_2", "linear_6"):
        assert re.search(rf"^ {node} ", plan, re.MULTILINE), node
    assert "3d M=a K=c N=b" in plan  # family and roles of the first linear
    assert "all_gather(b) 512 B ↔ reduce_scatter" in plan
    assert "reduce_scatter(c) 2.0 KiB ↔ all_gather" in plan
    summary = out[out.index("predicted communication") :]
    assert "total" in summary and "reduce_scatter" in summary
    assert "rank 0's program" in out
    assert (
        "autoshard_runtime_comm_all_gather(" in out
        and "autoshard_runtime_comm_reduce_scatter(" in out
    )
    assert "layers.0.fc1.weight" in out and "rows 0:16, cols 0:8" in out


def test_rank_changes_shards(capsys):
    first = show(capsys, "--mesh", "2x2x2", "--strategy", "3d", "--rank", "0")
    last = show(capsys, "--mesh", "2x2x2", "--strategy", "3d", "--rank", "7")
    assert "rank 7's program (mesh coordinate a=1, b=1, c=1)" in last
    # fc1.weight is S0(b,a) S1(c): rank 7 holds chunk 1*2+1 = 3 of 4 row chunks of 16
    assert holds(first, "layers.0.fc1.weight") == "rows 0:16, cols 0:8"
    assert holds(last, "layers.0.fc1.weight") == "rows 48:64, cols 8:16"
    assert holds(last, "layers.0.norm.weight") == "8:16"


def test_replicated_has_no_collectives(capsys):
    out = show(capsys, "--mesh", "2x2x2", "--strategy", "replicated", "--no-code")
    plan = plan_section(out)
    assert "replicated" in plan
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "split("):
        assert kind not in plan
    assert "none (no collectives" in out
    assert "def forward" not in out


def test_strategy_json_and_other_mesh(capsys):
    out = show(capsys, "--mesh", "1x2x4", "--strategy", '{"layers.*.fc1": "replicated"}')
    assert "1×2×4" in out
    fc1 = next(l for l in plan_section(out).splitlines() if l.startswith(" linear "))
    assert "replicated" in fc1
    assert "def forward" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "2x3x"], "--mesh '2x3x' is not a mesh shape"),
        (["--mesh", "2x2x2", "--strategy", "fancy"], "--strategy 'fancy' is not a strategy"),
        (["--mesh", "2x2x2", "--rank", "8"], "--rank 8 is not on the mesh"),
    ],
)
def test_bad_arguments_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) as exit:
        main(["show", f"{MLP}:mlp", *args])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_mesh_that_divides_nothing_plans_replicated_and_says_so(capsys):
    out = show(capsys, "--mesh", "3x3x3", "--strategy", "3d")
    assert "layers.0.fc1" in out and "runs replicated" in out


@pytest.mark.parametrize(
    "model, message",
    [
        (str(Path(__file__).parents[1] / "examples/missing.py") + ":mlp", "no file at"),
        (f"{MLP}:nothing", "defines no 'nothing'"),
        (MLP, "is not of the form path/to/file.py:factory"),
    ],
)
def test_bad_model_exits_2(capsys, model, message):
    with pytest.raises(SystemExit) as exit:
        main(["show", model, "--mesh", "2x2x2"])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_solved_with_a_budget_shows_the_cost_and_the_recomputed_nodes(capsys):
    out = show(capsys, "--mesh", "2x2x2", "--budget", "30KiB", "--hardware", "nvlink-8")
    assert "solved per block" in out and "recompute" in out
    assert "↺ recomputed" in plan_section(out)
    assert re.search(r"peak memory\s+│\s+[\d.]+ KiB \(budget 30.0 KiB\)", out)
    assert "torch.utils.checkpoint.checkpoint(recompute_layers_" in out


def test_an_impossible_budget_names_the_smallest(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["show", f"{MLP}:mlp", "--mesh", "2x2x2", "--budget", "1KiB"])
    assert exit_info.value.code == 2
    assert "smallest that fits is" in capsys.readouterr().err


def test_helpers():
    assert parse_mesh("2x2x2") == (2, 2, 2) and parse_mesh("1×2×4") == (1, 2, 4)
    mesh = Mesh.from_shape((2, 2, 2))
    assert rank_coordinate(mesh, 6) == {"a": 1, "b": 1, "c": 0}
    layout = Layout((("b", "a"), ("c",)))
    coord = rank_coordinate(mesh, 5)  # a=1, b=0, c=1: row chunk 0*2+1 = 1
    slices = layout.shard_slices((64, 16), mesh, coord)
    assert slices == [(16, 32), (8, 16)]
    assert slice_text((64, 16), slices) == "rows 16:32, cols 8:16"
    assert slice_text((16,), [(0, 16)]) == "all"


def test_summary_matches_plan_prediction():
    from autoshard.api import plan
    from autoshard.cli import predicted
    from autoshard.testing import load_factory

    model, inputs = load_factory(f"{MLP}:mlp")()
    the_plan = plan(model, (2, 2, 2), inputs, strategy="3d")
    rows = predicted(the_plan)
    assert sum(nbytes for _, nbytes, _ in rows.values()) == sum(the_plan.predicted_comm().values())
    assert all(calls > 0 and ring > 0 for calls, _, ring in rows.values())
    assert {phase for _, _, phase in rows} == {"forward", "backward"}


def test_show_a_12_layer_gpt(capsys):
    gpt = Path(__file__).parents[1] / "examples/gpt.py"
    assert main(["show", f"{gpt}:gpt_12l", "--mesh", "2x2x2", "--strategy", "3d", "--no-code"]) == 0
    plan = plan_section(capsys.readouterr().out)
    for block in range(12):
        assert f"blocks.{block}." in plan
    assert "vocab-parallel" in plan and "batch and heads" in plan


def _show_flags() -> set[str]:
    from autoshard.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    show_parser = commands.choices["show"]
    return {o for a in show_parser._actions for o in a.option_strings if o.startswith("--")}


def test_every_show_flag_reaches_the_planner(capsys, monkeypatch):
    # Each planning flag, set away from its default, arrives at plan_model as given;
    # the display flags change only what is printed. A new flag must join one list.
    from autoshard import api

    received = {}
    real = api.plan_model

    def spy(traced, mesh, options):
        received.update(vars(options), mesh=mesh)
        # what arrived is what counts: plan it the quick way (no solve) to show something
        quick = dataclasses.replace(options, strategy="3d", memory_budget=None)
        return real(traced, mesh, quick)

    monkeypatch.setattr(api, "plan_model", spy)
    planning = {
        "--mesh": ("1x2x4", lambda got: got["mesh"] == Mesh.from_shape((1, 2, 4))),
        "--strategy": ("3d-allreduce", lambda got: got["strategy"] == "3d-allreduce"),
        "--budget": ("1GiB", lambda got: got["memory_budget"] == 2**30),
        "--space": ("all", lambda got: got["strategy_space"] == "all"),
        "--hardware": ("ib-cluster", lambda got: got["hardware"].name == "ib-cluster"),
        "--loss-chunks": ("1", lambda got: got["loss_chunks"] == 1),
        "--no-overlap": (None, lambda got: got["overlap"] is False),
    }
    display = {"--rank": "3", "--no-code": None}
    assert _show_flags() == {"--help", *planning, *display}
    args = ["--mesh", "1x2x4"]
    for flag, (value, check) in planning.items():
        received.clear()
        extra = [] if flag == "--mesh" else [flag] if value is None else [flag, value]
        if flag == "--budget":
            extra += ["--strategy", "3d"]  # a budget takes a single family or the solver
        show(capsys, *args, *extra, "--no-code")
        assert check(received), (flag, received)
    assert "rank 3's program" in show(capsys, *args, "--rank", "3")
    assert "rank 0's program" not in show(capsys, *args, "--no-code")


def test_ops_lists_every_entry_and_what_it_provides(capsys):
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert f"({len(entries())} of {len(entries())};" in out
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line[:2] == "  " and line.strip()
    }
    assert rows["layer_norm.default"] == [
        "norm.layer_norm",
        "normalizing_flops",
        "2×",
        "forward",
        "_native_saved",
        "layer_norm",
    ]
    assert rows["linear.default"][:2] == ["linear.linear", "Product(left=0).flops"]
    assert rows["view.default"] == ["views.reshape", *["free", "(a", "view)"] * 2, "—", "shape"]
    assert rows["rms_norm.default"][:2] == ["norm.rms_norm", "normalizing_flops"]
    assert "operator.getitem" in rows


def test_ops_filters_by_name(capsys):
    assert main(["ops", "aten.embedding"]) == 0
    out = capsys.readouterr().out
    assert "(1 of" in out and "vocab_embedding" in out and "linear" not in out
    with pytest.raises(SystemExit) as exit:
        main(["ops", "no_such_op"])
    assert exit.value.code == 2
    assert "no op with an entry matches 'no_such_op'" in capsys.readouterr().err
