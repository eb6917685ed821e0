# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrapper below still carries full annotations.
"""``x @ weight.T (+ bias)`` for a few rows of ``x``: memory-bound products split over the output columns.

With one to sixteen rows the product reads the whole weight for very little arithmetic, so its time
is the weight's bytes over the bandwidth the launch reaches. cuBLAS picks GEMM tiles for these
shapes that leave most of the GPU idle at decode widths (a 1024 x 1024 weight takes about 7.7 us on
an H200, 0.27 TB/s). Here each program owns ``BLOCK_N`` output columns and streams their weight rows
over the whole ``K``: one row is a multiply and a row sum per tile (no tensor cores needed), two to
sixteen rows one ``tl.dot`` per tile with the rows padded to 16. Products accumulate in fp32 and are
rounded once, as cuBLAS does.
"""

from typing import Any

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import interpreted, launch_options, next_power_of_2


def one_row_configs() -> list[triton.Config]:
    """The row-sum kernels' tiles (shared with ``few_rows_swiglu_kernels``)."""
    if interpreted():
        return [triton.Config({"BLOCK_N": 8, "BLOCK_K": 32}, num_warps=1)]
    tiles = ((4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024), (16, 256), (16, 512))
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k in tiles
        for w in (4, 8)
        for s in (1, 2)
    ]


def dot_configs(tiles: tuple[tuple[int, int], ...], stages: tuple[int, ...]) -> list[triton.Config]:
    """The ``tl.dot`` kernels' tiles: each ``(BLOCK_N, BLOCK_K)`` at 4 and 8 warps and each stage count
    (one small tile in the interpreter; shared with ``few_rows_swiglu_kernels``)."""
    if interpreted():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=1)]
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k in tiles
        for w in (4, 8)
        for s in stages
    ]


def _few_rows_configs() -> list[triton.Config]:
    tiles = ((16, 128), (16, 256), (16, 512), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256))
    return dot_configs(tiles, stages=(3, 5))


@triton.jit
def _one_row_tile(x_ptr, w_ptr, b_ptr, y_ptr, tile, n, k, stride_w, HAS_BIAS, BLOCK_N, BLOCK_K):
    """Columns ``tile * BLOCK_N ..`` of one row's product."""
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, acc.to(y_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _few_rows_tile(
    x_ptr, w_ptr, b_ptr, y_ptr, tile, m, n, k, stride_x, stride_w, stride_y,
    HAS_BIAS, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
):  # fmt: skip
    """Columns ``tile * BLOCK_N ..`` of the product of ``m`` rows, one ``tl.dot`` per ``BLOCK_K``."""
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_mask, row_mask = cols < n, rows < m
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter computes bf16 products wrongly
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.autotune(configs=one_row_configs(), key=["n", "k"], cache_results=True)
@triton.jit
def _one_row_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, n, k, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    _one_row_tile(x_ptr, w_ptr, b_ptr, y_ptr, tl.program_id(0), n, k, stride_w, HAS_BIAS, BLOCK_N, BLOCK_K)


# BLOCK_M in the key: rows padded to 32 or 64 (a direct launch; the op stops at 16) tune apart
@triton.autotune(configs=_few_rows_configs(), key=["n", "k", "BLOCK_M"], cache_results=True)
@triton.jit
def _few_rows_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, stride_x, stride_w, stride_y,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    _few_rows_tile(
        x_ptr, w_ptr, b_ptr, y_ptr, tl.program_id(0), m, n, k, stride_x, stride_w, stride_y,
        HAS_BIAS, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


@triton.autotune(configs=one_row_configs(), key=["n0", "n1", "n2", "k"], cache_results=True)
@triton.jit
def _one_row_group_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, y0_ptr, y1_ptr, y2_ptr,
    n0, n1, n2, k, stride_w0, stride_w1, stride_w2,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Up to three weights' products of one row in one launch: the programs split over their tiles."""
    tile = tl.program_id(0)
    tiles0, tiles1 = tl.cdiv(n0, BLOCK_N), tl.cdiv(n1, BLOCK_N)
    if tile < tiles0:
        _one_row_tile(x_ptr, w0_ptr, b0_ptr, y0_ptr, tile, n0, k, stride_w0, HAS_BIAS, BLOCK_N, BLOCK_K)
    elif tile < tiles0 + tiles1:
        _one_row_tile(
            x_ptr, w1_ptr, b1_ptr, y1_ptr, tile - tiles0, n1, k, stride_w1, HAS_BIAS, BLOCK_N, BLOCK_K
        )
    else:
        _one_row_tile(
            x_ptr,
            w2_ptr,
            b2_ptr,
            y2_ptr,
            tile - tiles0 - tiles1,
            n2,
            k,
            stride_w2,
            HAS_BIAS,
            BLOCK_N,
            BLOCK_K,
        )


@triton.autotune(configs=_few_rows_configs(), key=["n0", "n1", "n2", "k", "BLOCK_M"], cache_results=True)
@triton.jit
def _few_rows_group_kernel(
    x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, y0_ptr, y1_ptr, y2_ptr,
    m, n0, n1, n2, k, stride_x, stride_w0, stride_w1, stride_w2,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Up to three weights' products of a few rows in one launch (outputs contiguous, ``n_i`` wide)."""
    tile = tl.program_id(0)
    tiles0, tiles1 = tl.cdiv(n0, BLOCK_N), tl.cdiv(n1, BLOCK_N)
    if tile < tiles0:
        _few_rows_tile(
            x_ptr, w0_ptr, b0_ptr, y0_ptr, tile, m, n0, k, stride_x, stride_w0, n0,
            HAS_BIAS, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    elif tile < tiles0 + tiles1:
        _few_rows_tile(
            x_ptr, w1_ptr, b1_ptr, y1_ptr, tile - tiles0, m, n1, k, stride_x, stride_w1, n1,
            HAS_BIAS, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    else:
        _few_rows_tile(
            x_ptr, w2_ptr, b2_ptr, y2_ptr, tile - tiles0 - tiles1, m, n2, k, stride_x, stride_w2, n2,
            HAS_BIAS, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip


def few_rows_linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(m, n)`` product of ``x`` ``(m, k)`` and ``weight`` ``(n, k)``, both with a contiguous last dim.

    One row takes the row-sum kernel, more the ``tl.dot`` kernel with the rows padded to a power of
    two (at least 16).
    """
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    bias_arg = bias if bias is not None else y

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    if m == 1:
        _one_row_kernel[grid](
            x, weight, bias_arg, y, n, k, weight.stride(0), **launch_options(HAS_BIAS=bias is not None)
        )
        return y
    precision = "ieee" if x.dtype == torch.float32 or interpreted() else "tf32"
    _few_rows_kernel[grid](
        x, weight, bias_arg, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        **launch_options(
            HAS_BIAS=bias is not None, UPCAST=interpreted(), PRECISION=precision,
            BLOCK_M=max(16, next_power_of_2(m)),
        ),
    )  # fmt: skip
    return y


GROUP_MAX = 3
"""Most weights ``few_rows_linear_group_kernel`` multiplies in one launch."""


def few_rows_linear_group_kernel(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """Each ``(m, n_i)`` product of ``x`` ``(m, k)`` with ``weights[i]`` ``(n_i, k)`` (at most
    ``GROUP_MAX``, contiguous last dims), in one launch; ``biases`` all given or None."""
    m, k = x.shape
    if not 1 <= len(weights) <= GROUP_MAX:
        raise ValueError(f"a group takes 1 to {GROUP_MAX} weights, got {len(weights)}")
    outs = [torch.empty((m, w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    if m == 0:
        return outs
    # absent members: zero columns, so no program reaches them (any valid pointer fills the slot)
    padded_w = [*weights, *[weights[0]] * (GROUP_MAX - len(weights))]
    padded_b = [*(outs if biases is None else biases), *[outs[0]] * (GROUP_MAX - len(weights))]
    padded_y = [*outs, *[outs[0]] * (GROUP_MAX - len(weights))]
    widths = [w.shape[0] for w in weights] + [0] * (GROUP_MAX - len(weights))
    strides = [w.stride(0) for w in padded_w]

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (sum(triton.cdiv(n, meta["BLOCK_N"]) for n in widths),)

    if m == 1:
        _one_row_group_kernel[grid](
            x, *padded_w, *padded_b, *padded_y, *widths, k, *strides,
            **launch_options(HAS_BIAS=biases is not None),
        )  # fmt: skip
        return outs
    precision = "ieee" if x.dtype == torch.float32 or interpreted() else "tf32"
    _few_rows_group_kernel[grid](
        x, *padded_w, *padded_b, *padded_y, m, *widths, k, x.stride(0), *strides,
        **launch_options(
            HAS_BIAS=biases is not None, UPCAST=interpreted(), PRECISION=precision,
            BLOCK_M=max(16, next_power_of_2(m)),
        ),
    )  # fmt: skip
    return outs
