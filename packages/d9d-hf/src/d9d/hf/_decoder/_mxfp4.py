"""MXFP4 (the OCP microscaling format) dequantized: GPT-OSS's ``*_blocks`` / ``*_scales`` expert tensors.

Each byte of ``blocks`` ``(..., rows, G, 16)`` packs two FP4 E2M1 values, the low nibble first, so
a block of 16 bytes holds 32 values; ``scales`` ``(..., rows, G)`` holds one E8M0 exponent per
block (bias 127). A value is ``fp4 * 2 ** (scale - 127)``; the rows of the result are
``(..., rows, G * 32)``, which GPT-OSS stores transposed: its experts are ``(E, in, out)``.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of the eight positive FP4 E2M1 codes; bit 3 of a nibble is the sign."""

BLOCK_BYTES = 16
"""Bytes per MXFP4 block (32 FP4 values under one scale)."""

_SCALE_BIAS = 127


def _e2m1_table() -> torch.Tensor:
    """The 16 FP4 codes as float32: ``E2M1_VALUES`` then their negations."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([magnitudes, -magnitudes])


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, chunk: int = 1
) -> torch.Tensor:
    """The ``(E, G * 32, rows)`` tensor that ``blocks`` ``(E, rows, G, 16)`` and ``scales``
    ``(E, rows, G)`` encode, in ``dtype``.

    Computed in float32, where every value is exact, then rounded once to ``dtype`` (exact for
    bfloat16 too, barring its narrower subnormal range). ``chunk`` experts are decoded at a time, so
    the float32 scratch stays at ``chunk`` experts' size.

    Raises:
        ValueError: If the shapes are not such a pair.
    """
    paired = blocks.dim() == 4 and blocks.shape[-1] == BLOCK_BYTES
    if not paired or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} are not a pair "
            f"(blocks (E, rows, G, {BLOCK_BYTES}), scales (E, rows, G))"
        )
    experts, rows, groups, _ = blocks.shape
    table = _e2m1_table().to(blocks.device)
    out = torch.empty(experts, groups * 2 * BLOCK_BYTES, rows, dtype=dtype, device=blocks.device)
    for start in range(0, experts, max(chunk, 1)):
        part = blocks[start : start + chunk].to(torch.uint8)
        codes = torch.stack([part & 0x0F, part >> 4], dim=-1).long()  # low nibble first
        values = table[codes].flatten(-2)  # (e, rows, G, 32)
        exponents = scales[start : start + chunk].to(torch.int32) - _SCALE_BIAS
        values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
        out[start : start + chunk] = values.flatten(-2).transpose(1, 2).to(dtype)
    return out
