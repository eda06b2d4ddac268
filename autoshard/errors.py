"""Errors autoshard raises. Each message names what is at fault and what to do."""


class AutoshardError(Exception):
    """Base class of every error autoshard raises on bad input."""


class MeshError(AutoshardError):
    """The mesh does not fit the process group or is malformed."""


class TraceError(AutoshardError):
    """torch.export could not trace the model."""


class ShapeError(AutoshardError):
    """A tensor dimension does not divide over the mesh axes that shard it."""


class InputError(AutoshardError):
    """Inputs or weights differ from what the module was planned for, or across ranks."""


class StrategyError(AutoshardError):
    """An unknown strategy name or a strategy that cannot be applied to a node."""


class HardwareError(AutoshardError):
    """An unknown hardware preset or a malformed hardware profile."""


class BudgetError(AutoshardError):
    """No plan fits the memory budget, or the budget is not a size."""


class PlanError(AutoshardError):
    """A saved plan is malformed, or was made for another model or mesh."""


def human_bytes(n: float) -> str:
    """2048 → ``2.0 KiB``; below 1 KiB in whole bytes."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


class CheckpointError(AutoshardError):
    """A checkpoint that does not fit the module (or optimizer) it is loaded into."""
