"""Model factories for the tests: each returns (model, example_inputs).

Rank processes load them by path (`tests/models.py:name`), so they must be
module-level functions with no arguments.
"""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from mlp import mlp as example_mlp  # noqa: E402


def mlp():
    return example_mlp(batch=8, seq=4, hidden=16, layers=2, dropout=0.1)


def mlp_2d_input():
    model, (x,) = example_mlp(batch=8, seq=4, hidden=16, layers=2, dropout=0.0)
    return model, (x.reshape(32, 16),)


class ThreeLinears(nn.Module):
    """X[T,H] through three linears; the middle one is W[H,O] with no bias."""

    def __init__(self, d_in=8, hidden=16, out=32):
        super().__init__()
        self.first = nn.Linear(d_in, hidden)
        self.middle = nn.Linear(hidden, out, bias=False)
        self.last = nn.Linear(out, d_in)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.tanh(self.first(x)))))


T, H, O = 16, 16, 32


def three_linears():
    return ThreeLinears(8, H, O), (torch.randn(T, 8),)


class Branchy(nn.Module):
    """Data-dependent control flow: torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def branchy():
    return Branchy(), (torch.randn(4, 8),)


class _PerturbedOnCopy(nn.Module):
    """Its deep copy (the serial reference) has one weight nudged by 1e-3."""

    def __init__(self):
        super().__init__()
        self.inner = example_mlp(batch=8, seq=4, hidden=16, layers=2, dropout=0.0)[0]

    def forward(self, x):
        return self.inner(x)

    def __deepcopy__(self, memo):
        twin = _PerturbedOnCopy.__new__(_PerturbedOnCopy)
        nn.Module.__init__(twin)
        twin.inner = __import__("copy").deepcopy(self.inner, memo)
        with torch.no_grad():
            twin.inner.layers[0].fc1.weight[0, 0] += 1e-3
        return twin


def perturbed_mlp():
    return _PerturbedOnCopy(), (torch.randn(8, 4, 16),)


def indivisible_mlp():
    """Hidden size 5 cannot be split over a mesh axis of 2."""
    return example_mlp(batch=8, seq=4, hidden=5, layers=1, dropout=0.0)


class Flipped(nn.Module):
    """aten.flip has no sharding rule: it must run replicated, with a warning."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.flip(self.fc1(x), dims=[-1]))


def flipped():
    return Flipped(), (torch.randn(8, 4, 16),)
