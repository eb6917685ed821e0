"""Applies rotary cos/sin tables to query and key heads through the fused ``apply_rope`` op."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels import RopeLayout, apply_rope


class RotaryApplicator(nn.Module):
    """Rotates the leading ``rotary_dim`` dims of every head; the rest pass through (partial RoPE).

    Args:
        layout: Must match the ``RotaryEmbedding`` that made the tables.
    """

    def __init__(self, layout: RopeLayout = "half") -> None:
        super().__init__()
        self.layout: RopeLayout = layout

    def reset_parameters(self) -> None:
        """No parameters; present so every layer can be reset uniformly."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x``.

        Args:
            x: ``(batch, seq, heads, head_dim)``.
            cos: ``(batch, seq, rotary_dim)`` with ``rotary_dim <= head_dim``.
            sin: Same shape as ``cos``.

        Returns:
            ``x`` with its leading ``rotary_dim`` dims rotated, in ``x.dtype``.
        """
        rotary_dim = cos.shape[-1]
        head_dim = x.shape[-1]
        if rotary_dim > head_dim:
            raise ValueError(f"rotary dim {rotary_dim} of cos/sin exceeds head_dim {head_dim}")
        if rotary_dim == head_dim:
            return apply_rope(x, cos, sin, layout=self.layout)
        rotated = apply_rope(x[..., :rotary_dim], cos, sin, layout=self.layout)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)

    def extra_repr(self) -> str:
        return f"layout={self.layout}"
