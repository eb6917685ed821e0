"""Modules the tests share."""

from __future__ import annotations

import torch
from torch import nn


class ScaledLinear(nn.Module):
    """A replacement of an ``nn.Linear`` (as LoRA's or FP8's are): a mode must call it, not group it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.linear(x)
