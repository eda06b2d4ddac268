"""Small models built around one op each, for the rules the zoo needs (`test_rules.py`).

Loaded by path in the rank processes (`tests/op_models.py:conv2d`): module-level
factories with no arguments returning ``(model, example_inputs)``.
"""

import torch
from torch import nn


class Conv2d(nn.Module):
    """A strided, padded patch conv with a bias, then a dilated grouped one without."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(4, 16, kernel_size=3, stride=2, padding=1)
        self.grouped = nn.Conv2d(16, 8, kernel_size=3, padding=2, dilation=2, groups=4, bias=False)

    def forward(self, x):
        return self.grouped(torch.relu(self.patch(x)))


class Conv1d(nn.Module):
    """Mamba's causal depthwise conv1d (groups = channels), then a pointwise conv."""

    def __init__(self, channels=16):
        super().__init__()
        self.depthwise = nn.Conv1d(channels, channels, kernel_size=4, padding=3, groups=channels)
        self.pointwise = nn.Conv1d(channels, 8, kernel_size=1)

    def forward(self, x):
        y = self.depthwise(x)[..., : x.shape[-1]]
        return self.pointwise(torch.nn.functional.silu(y))


def conv2d():
    return Conv2d(), (torch.randn(8, 4, 8, 8),)


def conv1d():
    return Conv1d(), (torch.randn(8, 16, 12),)
