"""Weight initialization shared by the layers."""

from __future__ import annotations

import torch
from torch import nn


def init_normal_(tensor: torch.Tensor, std: float) -> None:
    """Fills ``tensor`` with a normal distribution truncated at three standard deviations."""
    with torch.no_grad():
        nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std)


def init_linear_(linear: nn.Linear, std: float) -> None:
    """Truncated-normal weight, zero bias."""
    init_normal_(linear.weight, std)
    bias: torch.Tensor | None = getattr(linear, "bias", None)  # None when built with bias=False
    if bias is not None:
        with torch.no_grad():
            bias.zero_()
