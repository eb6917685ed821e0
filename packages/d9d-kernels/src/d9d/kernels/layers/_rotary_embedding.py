"""Rotary position embedding provider: cos/sin tables for (possibly packed) positions."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels import RopeLayout
from d9d.kernels.layers._rope_scaling import (
    LongRopeScaling,
    NtkRopeScaling,
    RopeScaling,
    compute_rope_frequencies,
)


class RotaryEmbedding(nn.Module):
    """Computes rotary cos/sin for given positions; one instance serves every attention layer.

    Positions come from the caller, so packed sequences get per-document positions (see
    ``position_ids_from_document_ids``). The inverse frequencies are a non-persistent buffer
    rebuilt by ``reset_parameters()``, so a model built on the meta device gets correct values
    after materialization. Under LongRoPE a second buffer holds the long-sequence frequencies, and
    each forward picks one of the two on the device from its longest position (no read on the
    host, so the forward stays capturable in a CUDA graph).

    Args:
        head_dim: Attention head size.
        theta: Base wavelength.
        scaling: Context-extension method; None is plain RoPE.
        partial_rotary_factor: Fraction of ``head_dim`` that is rotated (the leading dims).
        layout: ``"half"`` (rotate halves, Llama/Qwen) or ``"interleaved"`` (rotate pairs, GPT-J).
        device: Where to build the buffer.
    """

    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor  # LongRoPE's frequencies past the original context; empty otherwise

    def __init__(
        self,
        head_dim: int,
        *,
        theta: float = 10000.0,
        scaling: RopeScaling | None = None,
        partial_rotary_factor: float = 1.0,
        layout: RopeLayout = "half",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = int(head_dim * partial_rotary_factor)
        if rotary_dim <= 0 or rotary_dim % 2 != 0:
            raise ValueError(
                f"head_dim={head_dim} * partial_rotary_factor={partial_rotary_factor} gives rotary dim "
                f"{rotary_dim}; it must be a positive even number"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.scaling = scaling
        self.layout: RopeLayout = layout
        self.attention_factor = 1.0
        self.register_buffer(
            "inv_freq", torch.empty(rotary_dim // 2, dtype=torch.float32, device=device), persistent=False
        )
        long_size = rotary_dim // 2 if isinstance(scaling, LongRopeScaling) else 0
        self.register_buffer(
            "long_inv_freq", torch.empty(long_size, dtype=torch.float32, device=device), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Recomputes the inverse frequencies in place (on whatever device the buffer lives)."""
        frequencies, self.attention_factor = compute_rope_frequencies(
            self.rotary_dim, theta=self.theta, scaling=self.scaling
        )
        if self.inv_freq.device.type != "meta":
            with torch.no_grad():
                self.inv_freq.copy_(frequencies)
        if isinstance(self.scaling, LongRopeScaling) and self.long_inv_freq.device.type != "meta":
            long_frequencies, _ = compute_rope_frequencies(
                self.rotary_dim,
                theta=self.theta,
                scaling=self.scaling,
                sequence_length=self.scaling.original_max_position_embeddings + 1,
            )
            with torch.no_grad():
                self.long_inv_freq.copy_(long_frequencies)

    def _frequencies_for(self, position_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.scaling, NtkRopeScaling) and self.scaling.sequence_length is None:
            longest = int(position_ids.max().item()) + 1
            frequencies, _ = compute_rope_frequencies(
                self.rotary_dim,
                theta=self.theta,
                scaling=self.scaling,
                sequence_length=longest,
                device=position_ids.device,
            )
            return frequencies
        short = self.inv_freq.to(device=position_ids.device, dtype=torch.float32)
        if isinstance(self.scaling, LongRopeScaling):
            is_long = position_ids.max() + 1 > self.scaling.original_max_position_embeddings
            return torch.where(is_long, self.long_inv_freq.to(short.device), short)
        return short

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Builds cos and sin for the given positions.

        Args:
            position_ids: ``(batch, seq)`` integer positions.
            dtype: dtype of the returned tables (match the activations to mirror Hugging Face).

        Returns:
            ``(cos, sin)``, each ``(batch, seq, rotary_dim)``, already multiplied by the scaling's
            attention factor, laid out for ``self.layout``.
        """
        if position_ids.ndim != 2:
            raise ValueError(f"position_ids must be (batch, seq), got shape {tuple(position_ids.shape)}")
        angles = position_ids[..., None].to(torch.float32) * self._frequencies_for(position_ids)
        match self.layout:
            case "half":
                angles = torch.cat([angles, angles], dim=-1)
            case "interleaved":
                angles = angles.repeat_interleave(2, dim=-1)
        cos = angles.cos() * self.attention_factor
        sin = angles.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta}, "
            f"layout={self.layout}"
        )
