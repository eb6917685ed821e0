# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""MoE permutation Triton kernels: row scatter, weighted row gather-sum and its backward.

``inverse[t * K + k]`` is the permuted row of pair (t, k); every kernel runs one program per token
and column block, so each token's row is read once and no atomics are needed.
"""

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import launch_options, next_power_of_2

_MAX_BLOCK = 2048


@triton.jit
def _scatter_rows_kernel(src_ptr, dst_ptr, inverse_ptr, n_cols, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    row = tl.load(src_ptr + t * n_cols + cols, mask=mask)
    for k in range(TOP_K):
        dst_row = tl.load(inverse_ptr + t * TOP_K + k)
        tl.store(dst_ptr + dst_row * n_cols + cols, row, mask=mask)


@triton.jit
def _gather_sum_kernel(
    src_ptr,
    out_ptr,
    inverse_ptr,
    weights_ptr,
    n_cols,
    TOP_K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(TOP_K):
        src_row = tl.load(inverse_ptr + t * TOP_K + k)
        x = tl.load(src_ptr + src_row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            x = x * tl.load(weights_ptr + t * TOP_K + k).to(tl.float32)
        acc += x
    tl.store(out_ptr + t * n_cols + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_backward_kernel(
    dout_ptr,
    src_ptr,
    inverse_ptr,
    weights_ptr,
    dsrc_ptr,
    dweights_partial_ptr,
    n_cols,
    n_col_blocks,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dout = tl.load(dout_ptr + t * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    for k in range(TOP_K):
        src_row = tl.load(inverse_ptr + t * TOP_K + k)
        w = tl.load(weights_ptr + t * TOP_K + k).to(tl.float32)
        tl.store(dsrc_ptr + src_row * n_cols + cols, (dout * w).to(dsrc_ptr.dtype.element_ty), mask=mask)
        x = tl.load(src_ptr + src_row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dweights_partial_ptr + (t * TOP_K + k) * n_col_blocks + block, tl.sum(dout * x, axis=0))


def _geometry(n_tokens: int, n_cols: int) -> tuple[tuple[int, int], int]:
    block = min(next_power_of_2(n_cols), _MAX_BLOCK)
    return (n_tokens, triton.cdiv(n_cols, block)), block


def scatter_rows(src: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """``dst[inverse[t * K + k]] = src[t]`` for every token t and k < K."""
    n_tokens, n_cols = src.shape
    dst = torch.empty((n_tokens * top_k, n_cols), dtype=src.dtype, device=src.device)
    grid, block = _geometry(n_tokens, n_cols)
    if dst.numel() > 0:
        _scatter_rows_kernel[grid](
            src, dst, inverse, n_cols, **launch_options(TOP_K=top_k, BLOCK=block, num_warps=4)
        )
    return dst


def gather_sum(
    src: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * src[inverse[t * K + k]]`` (weights 1 when None), in fp32."""
    n_cols = src.shape[1]
    n_tokens = inverse.shape[0] // top_k
    out = torch.empty((n_tokens, n_cols), dtype=src.dtype, device=src.device)
    grid, block = _geometry(n_tokens, n_cols)
    if out.numel() > 0:
        _gather_sum_kernel[grid](
            src,
            out,
            inverse,
            weights if weights is not None else inverse,
            n_cols,
            **launch_options(TOP_K=top_k, WEIGHTED=weights is not None, BLOCK=block, num_warps=4),
        )
    return out


def unpermute_backward(
    dout: torch.Tensor, src: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``gather_sum`` for ``src`` and ``weights``."""
    n_tokens, top_k = weights.shape
    n_cols = src.shape[1]
    dsrc = torch.empty_like(src)
    grid, block = _geometry(n_tokens, n_cols)
    partial = torch.empty((n_tokens * top_k, grid[1]), dtype=torch.float32, device=src.device)
    if dsrc.numel() > 0:
        _unpermute_backward_kernel[grid](
            dout,
            src,
            inverse,
            weights,
            dsrc,
            partial,
            n_cols,
            grid[1],
            **launch_options(TOP_K=top_k, BLOCK=block, num_warps=4),
        )
    return dsrc, partial.sum(dim=1).view(n_tokens, top_k).to(weights.dtype)
