# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""Grouped GEMM Triton kernels (no host sync: programs find their group from the offsets).

The forward (and the input gradient, with transposed weights) launches ``cdiv(M, BLOCK_M) + G``
programs along M, an upper bound of the per-group tile count; each program computes the
per-group tile counts, finds which group and tile it owns, and exits if it owns none. The weight
gradient runs one program per (group, K tile, N tile) and loops over the group's rows.
"""

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import interpreted, launch_options, next_power_of_2


@triton.jit
def _grouped_mm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    offsets_ptr,
    n_groups,
    n_dim,
    k_dim,
    sx_m,
    sx_k,
    sw_g,
    sw_k,
    sw_n,
    so_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    g_mask = g < n_groups
    starts = tl.load(offsets_ptr + g, mask=g_mask, other=0)
    ends = tl.load(offsets_ptr + g + 1, mask=g_mask, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    total = tl.sum(tiles, axis=0)
    cumulative = tl.cumsum(tiles, axis=0)
    group = tl.minimum(tl.sum((cumulative <= pid_m).to(tl.int32), axis=0), n_groups - 1)
    tiles_before = tl.sum(tl.where(g < group, tiles, 0), axis=0)
    row_start = tl.sum(tl.where(g == group, starts, 0), axis=0) + (pid_m - tiles_before) * BLOCK_M
    row_end = tl.sum(tl.where(g == group, ends, 0), axis=0)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = (rows < row_end) & ((rows * 0 + pid_m) < total)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_dim
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None].to(tl.int64) * sx_m + ks[None, :] * sx_k
    w_tile = w_ptr + group.to(tl.int64) * sw_g + ks[:, None] * sw_k + cols[None, :] * sw_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_mask = (k0 + ks) < k_dim
        a = tl.load(x_tile, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_tile, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_tile += BLOCK_K * sx_k
        w_tile += BLOCK_K * sw_k
    out = out_ptr + rows[:, None].to(tl.int64) * so_m + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_weight_grad_kernel(
    x_ptr,
    dy_ptr,
    dw_ptr,
    offsets_ptr,
    k_dim,
    n_dim,
    sx_m,
    sdy_m,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < k_dim
    col_mask = cols < n_dim
    start = tl.load(offsets_ptr + group)
    end = tl.load(offsets_ptr + group + 1)
    ms = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(0, end - start, BLOCK_M):
        rows = start + m0 + ms
        m_mask = rows < end
        xt = tl.load(
            x_ptr + rows[None, :].to(tl.int64) * sx_m + ks[:, None],
            mask=k_mask[:, None] & m_mask[None, :],
            other=0.0,
        )
        dy = tl.load(
            dy_ptr + rows[:, None].to(tl.int64) * sdy_m + cols[None, :],
            mask=m_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            xt = xt.to(tl.float32)
            dy = dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    out = dw_ptr + group * k_dim * n_dim + ks[:, None] * n_dim + cols[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def group_offsets(tokens_per_group: torch.Tensor) -> torch.Tensor:
    """``[0, n_0, n_0 + n_1, ...]`` (G + 1,) int32 on the device of ``tokens_per_group``."""
    offsets = torch.zeros((tokens_per_group.shape[0] + 1,), dtype=torch.int32, device=tokens_per_group.device)
    offsets[1:] = torch.cumsum(tokens_per_group, dim=0)
    return offsets


def _precision(x: torch.Tensor) -> str:
    # fp32 inputs get full fp32 products (tl.dot would otherwise use TF32 on the GPU).
    return "ieee" if x.dtype == torch.float32 or interpreted() else "tf32"


def _tiles(x: torch.Tensor) -> tuple[int, int, int]:
    if x.dtype == torch.float32:
        return 64, 64, 32
    return 128, 128, 64


def grouped_mm_forward(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[rows of g] = x[rows of g] @ weight[g]``; ``weight`` (G, K, N) may be any strided view."""
    m, k = x.shape
    g, _, n = weight.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m, block_n, block_k = _tiles(x)
    grid = (triton.cdiv(m, block_m) + g, triton.cdiv(n, block_n))
    _grouped_mm_kernel[grid](
        x,
        weight,
        out,
        offsets,
        g,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        out.stride(0),
        **launch_options(
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            BLOCK_G=next_power_of_2(g),
            UPCAST=interpreted(),
            PRECISION=_precision(x),
            num_warps=8 if block_m == 128 else 4,
            num_stages=3,
        ),
    )
    return out


def grouped_mm_weight_grad(
    x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, n_groups: int
) -> torch.Tensor:
    """``dweight[g] = x[rows of g].T @ dy[rows of g]`` (G, K, N); zero for empty groups."""
    k, n = x.shape[1], dy.shape[1]
    dw = torch.empty((n_groups, k, n), dtype=x.dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    block_k, block_n, block_m = _tiles(x)
    grid = (n_groups, triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _grouped_weight_grad_kernel[grid](
        x,
        dy,
        dw,
        offsets,
        k,
        n,
        x.stride(0),
        dy.stride(0),
        **launch_options(
            BLOCK_M=block_m,
            BLOCK_K=block_k,
            BLOCK_N=block_n,
            UPCAST=interpreted(),
            PRECISION=_precision(x),
            num_warps=8 if block_k == 128 else 4,
            num_stages=3,
        ),
    )
    return dw
