"""Rowwise float8 casts of MoE expert operands: token rows, and weights per column or per row.

Every scale is a power of two, one per row of the token operand and one per (expert, column) or
(expert, row) of a weight, so scaling is exact. On CUDA one-pass Triton kernels
(``_float8_cast_kernels``) read each operand once; elsewhere ``quantize_rowwise`` runs.
"""

from collections.abc import Sequence

import torch

_FLOAT8 = torch.float8_e4m3fn
_FLOAT8_MAX = torch.finfo(_FLOAT8).max


def quantize_rowwise(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in float8 e4m3 with one power-of-two scale per slice along ``dim``.

    Returns:
        The float8 data (same shape and strides as ``t`` would get from an elementwise op) and the
        dequantizing scales (float32, ``dim`` kept with size 1): ``t ~= data * scale``.
    """
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(_FLOAT8_MAX / amax)))
    data = (t.float() * scale).clamp(-_FLOAT8_MAX, _FLOAT8_MAX).to(_FLOAT8)
    return data, scale.reciprocal()


def _joined(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=dim)


def _quantize_row_blocks(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, K_i)`` parts joined to ``(M, sum K_i)``: row-major float8, one scale per row ``(M, 1)``."""
    return quantize_rowwise(_joined(parts, dim=1), dim=1)


def _quantize_weight_columns(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, K, N)``: float8 column-major per group, one scale per (group, column) ``(G, 1, N)``."""
    data, scale = quantize_rowwise(weight.transpose(1, 2), dim=2)
    return data.contiguous().transpose(1, 2), scale.transpose(1, 2)


def _quantize_weight_rows(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, K, N_i)`` joined to ``(G, K, sum N_i)``: row-major, one scale per (group, row)."""
    return quantize_rowwise(_joined(weights, dim=2), dim=2)


def cast_rows(*parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, K_i)`` parts joined to row-major float8 ``(M, sum K_i)``, one scale per row ``(M, 1)``.

    On CUDA one Triton kernel reads each part once; elsewhere the reference.
    """
    detached = tuple(p.detach() for p in parts)
    if detached[0].is_cuda:
        from d9d.parallel import _float8_cast_kernels as kernels

        if kernels.rows_fit(*(p.shape[1] for p in detached)):
            return kernels.cast_rows(detached)
    return _quantize_row_blocks(detached)


def cast_weight_columns(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, K, N)``: float8 column-major per group, one scale per (group, column) ``(G, 1, N)``."""
    if weight.is_cuda:
        from d9d.parallel import _float8_cast_kernels as kernels

        return kernels.cast_weight_columns(weight.detach())
    return _quantize_weight_columns(weight.detach())


def cast_weight_rows(*weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, K, N_i)`` joined to row-major float8 ``(G, K, sum N_i)``, one scale per (group, row)."""
    detached = tuple(w.detach() for w in weights)
    if detached[0].is_cuda:
        from d9d.parallel import _float8_cast_kernels as kernels

        if kernels.rows_fit(*(w.shape[2] for w in detached)):
            return kernels.cast_weight_rows(detached)
    return _quantize_weight_rows(detached)
