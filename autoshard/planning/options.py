"""The planning settings, resolved once where the user gives them.

`autoshard.plan`, `parallelize` and the CLI take the same keywords; they become one
`PlanOptions` here, checked and in the units the solver works in (bytes, a
`Hardware`, an optimizer-state multiplier), and travel as one object to the solver.

    >>> options = PlanOptions.from_user(memory_budget="2GiB", hardware="ib-cluster")
    >>> options.memory_budget, options.hardware.name, options.optimizer
    (2147483648.0, 'ib-cluster', 2.0)
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.hardware import DEFAULT, Hardware
from autoshard.cost.model import OPTIMIZERS
from autoshard.errors import StrategyError
from autoshard.sizes import memory_budget as parse_budget


@dataclass(frozen=True)
class PlanOptions:
    hardware: Hardware
    strategy: str | dict | None = None  # a family, or module patterns → families; None: solve
    memory_budget: float | None = None  # bytes per rank; None: the hardware's memory
    strategy_space: str = "3d"  # what the solver chooses from ("3d" or "all")
    optimizer: float = OPTIMIZERS["adam"]  # optimizer-state bytes per parameter byte
    # gradient-bucket reductions overlap backward (`Plan.overlap`); None: on, or as a
    # saved plan says
    overlap: bool | None = None
    # pieces the loss runs in over the tokens (`autoshard.planning.chunking`): None, the
    # solver chooses; 1, never in pieces; k, in k pieces where the model allows it
    loss_chunks: int | None = None

    @classmethod
    def from_user(
        cls,
        *,
        strategy=None,
        memory_budget: float | str | None = None,
        hardware: Hardware | str | None = None,
        strategy_space: str = "3d",
        optimizer: str | float = "adam",
        overlap: bool | None = None,
        loss_chunks: int | None = None,
    ) -> PlanOptions:
        """The keywords of `autoshard.plan` as given (a budget like ``"80GiB"``, a
        hardware preset name or profile path, an optimizer name), resolved."""
        return cls(
            hardware=hardware
            if isinstance(hardware, Hardware)
            else Hardware.load(hardware or DEFAULT),
            strategy=strategy,
            memory_budget=parse_budget(memory_budget),
            strategy_space=strategy_space,
            optimizer=_optimizer(optimizer),
            overlap=_overlap(overlap),
            loss_chunks=_loss_chunks(loss_chunks),
        )


def _optimizer(optimizer: str | float) -> float:
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise StrategyError(
                f"unknown optimizer {optimizer!r}: choose one of {sorted(OPTIMIZERS)}"
            )
        return OPTIMIZERS[optimizer]
    return float(optimizer)


def _overlap(overlap: bool | None) -> bool | None:
    if overlap is not None and not isinstance(overlap, bool):
        raise StrategyError(f"overlap={overlap!r}: give True, False or None (the default)")
    return overlap


def _loss_chunks(chunks: int | None) -> int | None:
    whole = isinstance(chunks, int) and not isinstance(chunks, bool)
    if chunks is not None and (not whole or chunks < 1):
        raise StrategyError(
            f"loss_chunks={chunks!r}: give a positive number of pieces (1: never chunk the "
            "loss), or None to let the solver choose"
        )
    return chunks
