"""Rotary position embedding in plain PyTorch."""

from __future__ import annotations

from typing import Literal

import torch

from d9d.kernels._reference.precision import upcast


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: Literal["half", "interleaved"]
) -> torch.Tensor:
    """``x * cos + rotate(x) * sin`` in fp32, returned in ``x.dtype``.

    ``x`` is (batch, seq, heads, head_dim); ``cos`` and ``sin`` are (batch, seq, head_dim) and apply to
    every head. ``rotate`` pairs element ``i`` with ``i + head_dim / 2`` ("half", as in Llama / Qwen) or
    element ``2i`` with ``2i + 1`` ("interleaved", as in GPT-J).
    """
    xf = upcast(x)
    c = upcast(cos).unsqueeze(2)
    s = upcast(sin).unsqueeze(2)
    rotated = _rotate_half(xf) if layout == "half" else _rotate_interleaved(xf)
    return (xf * c + rotated * s).to(x.dtype)
