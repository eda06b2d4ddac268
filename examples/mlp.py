"""A residual MLP stack with LayerNorm: the smallest model autoshard parallelizes.

autoshard show examples/mlp.py:mlp --mesh 2x2x2
"""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class MLP(nn.Module):
    def __init__(self, hidden: int = 16, layers: int = 3, dropout: float = 0.1):
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(torch.tanh(self.norm(x)))


def mlp(batch: int = 8, seq: int = 4, hidden: int = 16, layers: int = 3, dropout: float = 0.1):
    """A factory for `autoshard show` and `assert_equivalent`: (model, example_inputs)."""
    return MLP(hidden, layers, dropout), (torch.randn(batch, seq, hidden),)
