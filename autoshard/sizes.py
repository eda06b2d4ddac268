"""Memory sizes as people write them: one parser for the Python API and the CLI.

>>> parse_bytes("512MiB")
536870912.0
>>> memory_budget("2GiB"), memory_budget(1e9), memory_budget(None)
(2147483648.0, 1000000000.0, None)
"""

from __future__ import annotations

import math

from autoshard.errors import BudgetError

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """'80GiB', '512MiB', '1.5e9', '2 GB' → bytes (case and spaces do not matter)."""
    number = text.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if unit and number.endswith(unit):
            number, scale = number[: -len(unit)], _UNITS[unit]
            break
    else:
        scale = 1
    try:
        return float(number.strip()) * scale
    except ValueError:
        raise BudgetError(
            f"memory budget {text!r} is not a size: write a number of bytes or e.g. "
            "'80GiB', '512MiB', '1e9'"
        ) from None


def memory_budget(value) -> float | None:
    """A budget in bytes from a number or a size string; None stays None (no budget).
    NaN, infinities, zero and negative sizes are refused: no plan fits them."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BudgetError(
            f"memory_budget {value!r} ({type(value).__name__}) is not a size: give bytes as a "
            "number or a string such as '2GiB'"
        )
    budget = parse_bytes(value) if isinstance(value, str) else float(value)
    if not math.isfinite(budget) or budget <= 0:
        raise BudgetError(
            f"memory_budget {value!r} is not a positive, finite number of bytes: give the "
            "memory per rank the plan may use, e.g. 40 * 2**30 or '40GiB'"
        )
    return budget
