# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrapper below still carries full annotations.
"""``silu(x @ gate.T) * (x @ up.T)`` for a few rows of ``x``: a feed-forward's gate, up and activation.

Each program owns ``BLOCK_N`` columns of both products: it streams the gate's and the up's weight
rows for those columns and loads each tile of ``x`` once for the two, where separate programs per
weight (the group kernel) each read ``x`` whole. The activation is the epilogue, so neither product
is written. The numerics are the unfused ones: each product accumulates in fp32 and is rounded once
to ``x``'s dtype, then ``silu(gate) * up`` is computed in fp32 from the rounded products and rounded.
"""

from typing import Any

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.few_rows_linear_kernels import dot_configs, one_row_configs
from d9d.kernels._triton.launch import interpreted, launch_options, next_power_of_2


def _few_rows_configs() -> list[triton.Config]:
    # each program holds two weights' tiles: no 512-wide inner tiles
    return dot_configs(((16, 128), (16, 256), (32, 128), (32, 256), (64, 64), (64, 128)), stages=(3, 4))


@triton.jit
def _activation(gate, up, b_gate_ptr, b_up_ptr, cols, col_mask, y_ptr, HAS_BIAS):
    """``silu(gate) * up`` of fp32 accumulators, each (with its bias) rounded to the output dtype first."""
    out_dtype = y_ptr.dtype.element_ty
    if HAS_BIAS:
        gate += tl.load(b_gate_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        up += tl.load(b_up_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    gate = gate.to(out_dtype).to(tl.float32)
    up = up.to(out_dtype).to(tl.float32)
    return (gate * tl.sigmoid(gate) * up).to(out_dtype)


@triton.autotune(configs=one_row_configs(), key=["n", "k"], cache_results=True)
@triton.jit
def _one_row_swiglu_kernel(
    x_ptr, g_ptr, u_ptr, bg_ptr, bu_ptr, y_ptr, n, k, stride_g, stride_u,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    g_rows = g_ptr + cols.to(tl.int64)[:, None] * stride_g
    u_rows = u_ptr + cols.to(tl.int64)[:, None] * stride_u
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        tile_mask = col_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_g = tl.load(g_rows + ks[None, :], mask=tile_mask, other=0.0)
        w_u = tl.load(u_rows + ks[None, :], mask=tile_mask, other=0.0)
        acc_g += tl.sum(w_g.to(tl.float32) * x, axis=1)
        acc_u += tl.sum(w_u.to(tl.float32) * x, axis=1)
    y = _activation(acc_g, acc_u, bg_ptr, bu_ptr, cols, col_mask, y_ptr, HAS_BIAS)
    tl.store(y_ptr + cols, y, mask=col_mask)


@triton.autotune(configs=_few_rows_configs(), key=["n", "k", "BLOCK_M"], cache_results=True)
@triton.jit
def _few_rows_swiglu_kernel(
    x_ptr, g_ptr, u_ptr, bg_ptr, bu_ptr, y_ptr, m, n, k, stride_x, stride_g, stride_u,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_mask, row_mask = cols < n, rows < m
    g_rows = g_ptr + cols.to(tl.int64)[:, None] * stride_g
    u_rows = u_ptr + cols.to(tl.int64)[:, None] * stride_u
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        w_mask = col_mask[:, None] & k_mask[None, :]
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_g = tl.load(g_rows + ks[None, :], mask=w_mask, other=0.0)
        w_u = tl.load(u_rows + ks[None, :], mask=w_mask, other=0.0)
        if UPCAST:  # Triton's interpreter computes bf16 products wrongly
            x, w_g, w_u = x.to(tl.float32), w_g.to(tl.float32), w_u.to(tl.float32)
        acc_g = tl.dot(x, tl.trans(w_g), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, tl.trans(w_u), acc_u, input_precision=PRECISION)
    y = _activation(acc_g, acc_u, bg_ptr, bu_ptr, cols[None, :], col_mask[None, :], y_ptr, HAS_BIAS)
    out = y_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :]
    tl.store(out, y, mask=row_mask[:, None] & col_mask[None, :])


def few_rows_swiglu_kernel(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """``(m, n)`` ``silu(x @ gate_weight.T) * (x @ up_weight.T)`` (plus biases) in one launch.

    ``x`` is ``(m, k)``, both weights ``(n, k)``, all with a contiguous last dim. One row takes the
    row-sum kernel, more the ``tl.dot`` kernel with the rows padded to a power of two (at least 16).
    """
    m, k = x.shape
    n = gate_weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    b_gate, b_up = biases if biases is not None else (y, y)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    if m == 1:
        _one_row_swiglu_kernel[grid](
            x, gate_weight, up_weight, b_gate, b_up, y, n, k, gate_weight.stride(0), up_weight.stride(0),
            **launch_options(HAS_BIAS=biases is not None),
        )  # fmt: skip
        return y
    precision = "ieee" if x.dtype == torch.float32 or interpreted() else "tf32"
    _few_rows_swiglu_kernel[grid](
        x, gate_weight, up_weight, b_gate, b_up, y, m, n, k,
        x.stride(0), gate_weight.stride(0), up_weight.stride(0),
        **launch_options(
            HAS_BIAS=biases is not None, UPCAST=interpreted(), PRECISION=precision,
            BLOCK_M=max(16, next_power_of_2(m)),
        ),
    )  # fmt: skip
    return y
