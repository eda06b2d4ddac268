"""`Formula`: a sympy expression (to print, and to check against closed forms in
tests) and the plain-float function made from it once (the solver evaluates it
thousands of times).

>>> import sympy
>>> a, b = sympy.symbols("a b", positive=True)
>>> area = Formula(a * b / 2, a, b)
>>> str(area), area(3, 4)
('a*b/2', 6.0)
"""

from __future__ import annotations

from functools import cached_property

import sympy


class Formula:
    """A sympy expression and the fast float function of `symbols` made from it."""

    def __init__(self, expr: sympy.Expr, *symbols: sympy.Symbol):
        self.expr = expr
        self.symbols = symbols

    @cached_property
    def _fn(self):
        return sympy.lambdify(self.symbols, self.expr, "math")

    def __call__(self, *values: float) -> float:
        return self._fn(*values)

    def __str__(self) -> str:
        return str(self.expr)
