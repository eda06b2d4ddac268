"""Hardware numbers the cost model needs, as data: presets and measured profiles.

A `Hardware` profile gives the compute roofline of one device (peak FLOP/s per
dtype, memory bandwidth, an efficiency and a per-op launch floor), its memory,
and one alpha-beta `Link` per mesh axis: an axis may run inside a node over
NVLink or across nodes over InfiniBand, so each has its own latency α and
bandwidth β. Presets live in ``autoshard/cost/profiles/NAME.json``; `autoshard
calibrate` measures a profile on a live mesh and writes the same format.

    >>> hw = Hardware.load("nvlink-8")                  # a preset, or a path to a JSON file
    >>> hw.axes[0]
    Link(alpha=4e-06, beta=450000000000.0)
    >>> hw.peak("bfloat16") / 1e12
    989.0
    >>> import tempfile
    >>> copy = Path(tempfile.mkdtemp()) / "copy.json"
    >>> hw.save(copy)
    >>> Hardware.load(copy) == hw
    True

`DEFAULT` (``"nvlink-8"``) is the profile used when none is given.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch

from autoshard.errors import HardwareError

DEFAULT = "nvlink-8"


@dataclass(frozen=True)
class Link:
    """One mesh axis's interconnect: a message costs ``alpha + bytes / beta`` seconds."""

    alpha: float  # seconds per message (latency)
    beta: float  # bytes per second each rank sends


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float] = field(hash=False)  # FLOP/s by dtype name ("float32", ...)
    memory_bandwidth: float  # bytes/s
    efficiency: float  # fraction of peak FLOP/s and bandwidth that real ops reach, 0..1
    launch_floor: float  # seconds every op costs at least (kernel launch, dispatch)
    memory_per_device: int  # bytes
    axes: tuple[Link, ...]  # one per mesh axis a, b, c
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        """Refuse numbers the cost model cannot use: a negative β predicts negative
        step times, an efficiency of 0 divides by zero."""
        positive = {f"peak_flops[{k!r}]": v for k, v in self.peak_flops.items()}
        positive |= {"memory_bandwidth": self.memory_bandwidth}
        positive |= {"memory_per_device": self.memory_per_device}
        positive |= {f"axes[{i}].beta": link.beta for i, link in enumerate(self.axes)}
        at_least_zero = {"launch_floor": self.launch_floor}
        at_least_zero |= {f"axes[{i}].alpha": link.alpha for i, link in enumerate(self.axes)}
        where = f"hardware profile {self.name!r}"
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise HardwareError(f"{where}: {name} = {value} must be a positive finite number")
        for name, value in at_least_zero.items():
            if not (math.isfinite(value) and value >= 0):
                raise HardwareError(f"{where}: {name} = {value} must be a finite number ≥ 0")
        if not (0 < self.efficiency <= 1):
            raise HardwareError(
                f"{where}: efficiency = {self.efficiency} must be in (0, 1], the fraction of peak "
                "FLOP/s and bandwidth real ops reach (e.g. 0.7)"
            )
        if "float32" not in self.peak_flops:
            raise HardwareError(
                f"{where}: peak_flops needs a 'float32' entry (other dtypes fall back to it)"
            )

    def peak(self, dtype: torch.dtype | str) -> float:
        """Peak FLOP/s for `dtype`; dtypes without an entry (integers, bool) use float32's."""
        name = str(dtype).removeprefix("torch.")
        return self.peak_flops.get(name, self.peak_flops["float32"])

    def link(self, axis: int) -> Link:
        return self.axes[axis]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: dict) -> Hardware:
        try:
            hardware = cls(
                name=str(data["name"]),
                peak_flops={str(k): float(v) for k, v in data["peak_flops"].items()},
                memory_bandwidth=float(data["memory_bandwidth"]),
                efficiency=float(data["efficiency"]),
                launch_floor=float(data["launch_floor"]),
                memory_per_device=int(data["memory_per_device"]),
                axes=tuple(Link(float(a["alpha"]), float(a["beta"])) for a in data["axes"]),
                source=str(data.get("source", "")),
            )
        except HardwareError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise HardwareError(
                f"malformed hardware profile {data.get('name', '?')!r}: {type(e).__name__}: {e}; "
                "see autoshard/cost/profiles/*.json for the format"
            ) from None
        if len(hardware.axes) != 3:
            raise HardwareError(
                f"hardware profile {hardware.name!r} gives {len(hardware.axes)} axes: give one "
                "link for each of the three mesh axes a, b, c (autoshard always plans on three)"
            )
        return hardware

    @classmethod
    def load(cls, name_or_path: str | Path) -> Hardware:
        """A preset by name (``"nvlink-8"``, ``"ib-cluster"``, ``"cpu-gloo"``) or a JSON file."""
        path = Path(name_or_path)
        if path.suffix == ".json" or path.is_file():
            if not path.is_file():
                raise HardwareError(f"no hardware profile file at {str(path)!r}")
            text = path.read_text()
        else:
            preset = resources.files("autoshard.cost") / "profiles" / f"{name_or_path}.json"
            if not preset.is_file():
                raise HardwareError(
                    f"unknown hardware {str(name_or_path)!r}: choose a preset "
                    f"({', '.join(presets())}) or give a path to a JSON profile "
                    "(`autoshard calibrate` writes one)"
                )
            text = preset.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise HardwareError(
                f"hardware profile {str(name_or_path)!r} is not JSON: {e}"
            ) from None
        return cls.from_dict(data)


def presets() -> list[str]:
    """The names of the bundled presets."""
    folder = resources.files("autoshard.cost") / "profiles"
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )
