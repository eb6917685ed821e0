# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped, so strict checking of kernel bodies reports every expression;
# the launch wrappers below carry full annotations.
"""One-pass float8 (e4m3) casts with power-of-two scales: Triton kernels for the FP8 grouped GEMMs.

A row cast holds its row in registers: one read, one write, the scale from the row's maximum in
between. A column cast (a weight written column-major per group) reads its stripe of columns twice,
once for the maxima and once to scale and write. The scale is ``2**floor(log2(448 / amax))``,
taken from ``amax``'s exponent and mantissa bits, so no division or logarithm rounds it; it equals
d9d.parallel's ``quantize_rowwise`` for every bf16 maximum.

Imported only when a CUDA tensor is cast (or by tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

_FLOAT8 = torch.float8_e4m3fn
_WIDEST_ROW = 16384
"""Widest row part a row cast keeps in registers."""


@triton.jit
def _power_of_two_scales(amax):
    """``(scale, inverse)``: ``scale = 2**floor(log2(448 / amax))`` exactly, from ``amax``'s bits."""
    bits = tl.maximum(amax, 1e-12).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # 448 = 1.75 * 2**8, so 448 / amax >= 2**(8 - exponent) exactly when amax's mantissa <= 1.75
    shift = tl.where((bits & 0x7FFFFF) <= 0x600000, 8 - exponent, 7 - exponent)
    scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return scale, inverse


@triton.jit
def _rows_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    inverse_ptr,
    stride_a,
    stride_b,
    stride_out,
    width_a,
    width_b,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HAS_B: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols_a = tl.arange(0, BLOCK_A)
    a = tl.load(a_ptr + row * stride_a + cols_a, mask=cols_a < width_a, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(a), axis=0)
    if HAS_B:
        cols_b = tl.arange(0, BLOCK_B)
        b = tl.load(b_ptr + row * stride_b + cols_b, mask=cols_b < width_b, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(b), axis=0))
    scale, inverse = _power_of_two_scales(amax)
    out_row = out_ptr + row * stride_out
    data_a = tl.clamp(a * scale, -448.0, 448.0)
    tl.store(out_row + cols_a, data_a.to(out_ptr.dtype.element_ty), mask=cols_a < width_a)
    if HAS_B:
        data_b = tl.clamp(b * scale, -448.0, 448.0)
        tl.store(out_row + width_a + cols_b, data_b.to(out_ptr.dtype.element_ty), mask=cols_b < width_b)
    tl.store(inverse_ptr + row, inverse)


@triton.jit
def _columns_kernel(
    weight_ptr,
    out_ptr,
    inverse_ptr,
    rows,
    columns,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < columns
    source = weight_ptr + group * rows * columns
    amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, rows, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        mask = (ks[:, None] < rows) & col_mask[None, :]
        tile = tl.load(source + ks[:, None] * columns + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(tile.to(tl.float32)), axis=0))
    scale, inverse = _power_of_two_scales(amax)
    target = out_ptr + group * rows * columns
    for start in range(0, rows, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        mask = (ks[:, None] < rows) & col_mask[None, :]
        tile = tl.load(source + ks[:, None] * columns + cols[None, :], mask=mask, other=0.0)
        data = tl.clamp(tile.to(tl.float32) * scale[None, :], -448.0, 448.0)
        tl.store(target + cols[None, :] * rows + ks[:, None], data.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(inverse_ptr + group * columns + cols, inverse, mask=col_mask)


def _launch(**options: Any) -> dict[str, Any]:
    return options


def _warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 4096 else 4


def rows_fit(*widths: int) -> bool:
    """Whether rows of these part widths fit one program's registers (``cast_rows`` takes them)."""
    return all(width <= _WIDEST_ROW for width in widths)


def cast_rows(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One or two ``(M, K_i)`` parts joined to ``(M, sum K_i)`` float8, one scale per row.

    Raises:
        ValueError: If there are not one or two parts.

    Returns:
        The row-major float8 data and the dequantizing scales ``(M, 1)`` float32.
    """
    if len(parts) not in (1, 2):
        raise ValueError(f"cast_rows joins one or two parts, got {len(parts)}")
    a = parts[0] if parts[0].stride(-1) == 1 else parts[0].contiguous()
    b = a if len(parts) == 1 else parts[1] if parts[1].stride(-1) == 1 else parts[1].contiguous()
    rows, width_a = a.shape
    width_b = b.shape[1] if len(parts) == 2 else 0
    out = torch.empty((rows, width_a + width_b), dtype=_FLOAT8, device=a.device)
    inverse = torch.empty((rows, 1), dtype=torch.float32, device=a.device)
    if rows == 0:
        return out, inverse
    block_a = triton.next_power_of_2(width_a)
    block_b = triton.next_power_of_2(max(width_b, 1))
    _rows_kernel[(rows,)](
        a,
        b,
        out,
        inverse,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        width_a,
        width_b,
        **_launch(
            BLOCK_A=block_a, BLOCK_B=block_b, HAS_B=len(parts) == 2, num_warps=_warps(block_a + block_b)
        ),
    )
    return out, inverse


def cast_weight_rows(weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, K, N_i)`` weights joined to ``(G, K, sum N_i)`` float8, one scale per (group, row)."""
    groups, rows = weights[0].shape[:2]
    flat = tuple(w.contiguous().view(groups * rows, w.shape[2]) for w in weights)
    data, inverse = cast_rows(flat)
    return data.view(groups, rows, -1), inverse.view(groups, rows, 1)


def cast_weight_columns(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, K, N)`` to float8 column-major per group, one scale per (group, column) ``(G, 1, N)``."""
    weight = weight.contiguous()
    groups, rows, columns = weight.shape
    out = torch.empty((groups, columns, rows), dtype=_FLOAT8, device=weight.device)
    inverse = torch.empty((groups, 1, columns), dtype=torch.float32, device=weight.device)
    if groups and rows and columns:
        block_n = 64
        _columns_kernel[(groups, triton.cdiv(columns, block_n))](
            weight, out, inverse, rows, columns, **_launch(BLOCK_K=64, BLOCK_N=block_n, num_warps=4)
        )
    return out.transpose(1, 2), inverse
