"""Hardware profiles: presets, JSON round trips, errors, and calibration on a live mesh."""

import json

import pytest

from autoshard.cli import main
from autoshard.cost.hardware import DEFAULT, Hardware, HardwareError, Link, presets
from autoshard.runtime.calibrate import calibrate


def test_presets_load():
    assert presets() == ["cpu-gloo", "ib-cluster", "nvlink-8"]
    for name in presets():
        hw = Hardware.load(name)
        assert hw.name == name and hw.source  # every preset says where its numbers come from
        assert len(hw.axes) == 3 and all(link.alpha > 0 and link.beta > 0 for link in hw.axes)
        assert 0 < hw.efficiency <= 1 and hw.memory_per_device > 0
    assert Hardware.load(DEFAULT).name == "nvlink-8"


def test_preset_numbers():
    nvlink = Hardware.load("nvlink-8")
    assert nvlink.axes == (Link(4e-6, 450e9),) * 3
    assert nvlink.peak("bfloat16") == nvlink.peak("float16") == 989e12
    assert nvlink.peak("float32") == 67e12
    assert nvlink.peak("int64") == nvlink.peak("float32")  # no entry: float32's
    assert nvlink.memory_per_device == 80 * 2**30
    ib = Hardware.load("ib-cluster")
    a, b, c = ib.axes
    assert a == b == Link(15e-6, 50e9) and c == nvlink.axes[2]  # c inside a node


def test_unknown_preset_lists_the_presets():
    with pytest.raises(
        HardwareError, match="unknown hardware 'h100'.*cpu-gloo, ib-cluster, nvlink-8"
    ):
        Hardware.load("h100")


def test_missing_file(tmp_path):
    with pytest.raises(HardwareError, match="no hardware profile file"):
        Hardware.load(tmp_path / "none.json")


def test_malformed_profiles(tmp_path):
    data = json.loads(Hardware.load("cpu-gloo").to_json())
    del data["memory_bandwidth"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HardwareError, match="malformed.*memory_bandwidth"):
        Hardware.load(path)
    data = json.loads(Hardware.load("cpu-gloo").to_json())
    data["axes"] = data["axes"][:2]
    with pytest.raises(HardwareError, match="gives 2 axes"):
        Hardware.from_dict(data)


def test_json_round_trip(tmp_path):
    for name in presets():
        hw = Hardware.load(name)
        hw.save(tmp_path / f"{name}.json")
        again = Hardware.load(tmp_path / f"{name}.json")
        assert again == hw and hash(again) == hash(hw)
        assert Hardware.from_dict(json.loads(hw.to_json())) == hw


def test_calibrate_two_ranks(tmp_path, capsys):
    base = Hardware.load("cpu-gloo")
    hw = calibrate((2,), sizes=(4 << 10, 64 << 10, 1 << 20), repeats=3)
    a, b, c = hw.axes
    assert a.alpha > 0 and a.beta > 0
    assert (b, c) == base.axes[1:]  # size-1 axes keep the base's links
    assert hw.peak("float32") > 0 and hw.peak("bfloat16") == base.peak("bfloat16")
    assert hw.name == "calibrated-2" and "autoshard calibrate" in hw.source
    hw.save(tmp_path / "measured.json")
    assert Hardware.load(tmp_path / "measured.json") == hw

    out = tmp_path / "cli.json"  # the CLI reuses the same two ranks
    assert main(["calibrate", "--mesh", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "α measured" in printed and "GFLOP/s" in printed and f"wrote {out}" in printed
    assert Hardware.load(out).axes[0].alpha > 0
