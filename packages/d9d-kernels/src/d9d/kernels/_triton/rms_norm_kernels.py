# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""RMSNorm forward and backward Triton kernels over tiles of ROWS x BLOCK elements.

A tile holds several rows when rows are short (32 rows of 128 for Qwen3's qk-norm), so each program
moves a few thousand elements instead of one short row, and narrow norms stop being latency-bound.
"""

import functools
from dataclasses import dataclass, replace
from typing import Literal

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import launch_options, next_power_of_2, warps_for_block

TILE_ELEMENTS = 4096
"""Elements (rows x padded columns) one program holds at a time, unless a row alone is wider."""
MAX_TILE_ROWS = 64
BACKWARD_PROGRAMS_PER_SM = 4
"""Persistent backward programs per multiprocessor: enough loads in flight to saturate memory."""
_PARTIAL_ROWS = 128
_PARTIAL_COLUMNS = 16


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small fixed count in Triton's CPU interpreter."""
    if device.type != "cuda":
        return 2
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)


def tile_rows(block: int) -> int:
    """Rows per tile for rows padded to ``block`` columns: about TILE_ELEMENTS per tile."""
    return max(1, min(MAX_TILE_ROWS, TILE_ELEMENTS // block))


@dataclass(frozen=True)
class BackwardLaunch:
    """How a norm's persistent backward kernel is launched.

    Attributes:
        rows: Rows per tile.
        warps: Warps per program.
        programs_per_sm: Persistent programs per multiprocessor.
    """

    rows: int
    warps: int
    programs_per_sm: int


NormBackwardKernel = Literal["rms_norm", "rms_norm_add", "rms_norm_add_next"]
"""A backward kernel: ``rms_norm``'s, ``rms_norm_add``'s without and with the next norm."""


def backward_launch(kernel: NormBackwardKernel, block: int) -> BackwardLaunch:
    """The launch of ``kernel`` over rows padded to ``block`` columns.

    Chosen from ``benchmarks/bench_norm_backward_launch.py`` on an H100 at 16384 rows (bf16); the
    forward's tiles and warps with ``BACKWARD_PROGRAMS_PER_SM`` where no other was faster:

    - 2048 (1025 to 2048 columns): 4 warps; the one-norm kernels on 8 programs a multiprocessor
      (at 1152 columns ``rms_norm`` 54.8 us against 62.6, ``rms_norm_add`` 70.5 against 80.7; at
      2048 78.5 against 84.9 and 104.1 against 111.6), the two-norm kernel on 4 (114.3 us against
      115.4 on 2: level);
    - 4096, the two-norm kernel: two rows a tile on 16 warps, 2 programs a multiprocessor (270.1 us
      against 338.2 at 2560 columns).
    """
    rows = tile_rows(block)
    match kernel, block:
        case (("rms_norm" | "rms_norm_add"), 2048):
            return BackwardLaunch(rows, 4, 8)
        case "rms_norm_add_next", 2048:
            return BackwardLaunch(rows, 4, BACKWARD_PROGRAMS_PER_SM)
        case "rms_norm_add_next", 4096:
            return BackwardLaunch(2, 16, 2)
        case _:
            return BackwardLaunch(rows, warps_for_block(rows * block), BACKWARD_PROGRAMS_PER_SM)


@triton.jit
def _tile(tile, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``tile``'s row indices (int64), column indices, and masks of its rows, columns and elements."""
    rows = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    return rows, cols, row_mask, col_mask, row_mask[:, None] & col_mask[None, :]


@triton.jit
def _normalized(x, w_ptr, cols, col_mask, n_cols, eps, ZERO_CENTERED: tl.constexpr):
    """``(y, rstd)``: fp32 rows ``x`` of a tile normalized and scaled, and their inverse RMS."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    return x * rstd[:, None] * w[None, :], rstd


@triton.jit
def _input_gradient(x_hat, wdy, rstd, n_cols):
    """The input gradient of fp32 tile rows of ``n_cols`` columns: ``x_hat`` the normalized input,
    ``wdy`` the scale times the output's gradient, ``rstd`` the rows' inverse RMS."""
    c = tl.sum(x_hat * wdy, axis=1) / n_cols
    return (wdy - x_hat * c[:, None]) * rstd[:, None]


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    stride_x,
    stride_y,
    n_rows,
    n_cols,
    eps,
    ZERO_CENTERED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, cols, row_mask, col_mask, mask = _tile(tl.program_id(0), n_rows, n_cols, ROWS, BLOCK)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y, rstd = _normalized(x, w_ptr, cols, col_mask, n_cols, eps, ZERO_CENTERED)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _add_rms_norm_kernel(
    residual_ptr,
    branch_ptr,
    w_ptr,
    total_ptr,
    y_ptr,
    stride_residual,
    stride_branch,
    n_rows,
    n_cols,
    eps,
    ZERO_CENTERED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, cols, _, col_mask, mask = _tile(tl.program_id(0), n_rows, n_cols, ROWS, BLOCK)
    residual = tl.load(residual_ptr + rows[:, None] * stride_residual + cols[None, :], mask=mask, other=0.0)
    branch = tl.load(branch_ptr + rows[:, None] * stride_branch + cols[None, :], mask=mask, other=0.0)
    # the sum rounded to the stream's dtype, as the unfused add stores it, and normalized from there
    total = (residual.to(tl.float32) + branch.to(tl.float32)).to(total_ptr.dtype.element_ty)
    out = rows[:, None] * n_cols + cols[None, :]
    tl.store(total_ptr + out, total, mask=mask)
    y, _ = _normalized(total.to(tl.float32), w_ptr, cols, col_mask, n_cols, eps, ZERO_CENTERED)
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    tiles_per_program,
    ZERO_CENTERED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw_acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for i in range(0, tiles_per_program):
        # Tiles are dealt round-robin; past the last tile every row is masked (no memory traffic).
        rows, _, row_mask, _, mask = _tile(pid + i * programs, n_rows, n_cols, ROWS, BLOCK)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        dx = _input_gradient(x_hat, w[None, :] * dy, rstd, n_cols)
        tl.store(
            dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask
        )
        dw_acc += dy * x_hat
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


@triton.jit
def _sum_partials_kernel(
    partial_ptr,
    out_ptr,
    second_out_ptr,
    n_partials,
    n_cols,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    which = tl.program_id(1)
    col_mask = cols < n_cols
    base = partial_ptr + which.to(tl.int64) * n_partials * n_cols
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for start in range(0, n_partials, ROWS):
        rows = start + tl.arange(0, ROWS)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(base + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)
    else:
        tl.store(second_out_ptr + cols, total.to(second_out_ptr.dtype.element_ty), mask=col_mask)


def sum_partials(partials: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> tuple[torch.Tensor, ...]:
    """Column sums of each ``(programs, n_cols)`` fp32 slice of ``partials``, one launch for all.

    ``partials`` is ``(len(dtypes), programs, n_cols)``, contiguous, and sum ``i`` is returned in
    ``dtypes[i]``. A fixed order (deterministic), over narrow column strips so that a few
    thousand columns still fill the GPU: a weight gradient of 1152 columns summed by
    ``partials.sum(0)`` took 14-17 us on an H100, mostly latency.
    """
    count, n_partials, n_cols = partials.shape
    if count not in (1, 2) or len(dtypes) != count:
        raise ValueError(
            f"sum_partials: {count} slices of partials and {len(dtypes)} dtypes, expected 1 or 2 each"
        )
    outs = tuple(torch.empty((n_cols,), dtype=dtype, device=partials.device) for dtype in dtypes)
    _sum_partials_kernel[(triton.cdiv(n_cols, _PARTIAL_COLUMNS), count)](
        partials,
        outs[0],
        outs[-1],
        n_partials,
        n_cols,
        **launch_options(ROWS=_PARTIAL_ROWS, BLOCK=_PARTIAL_COLUMNS, num_warps=4),
    )
    return outs


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered_weight: bool,
    *,
    rows_per_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(y, rstd)``: the normalized rows and each row's fp32 reciprocal RMS.

    Args:
        x: Input of shape (..., hidden).
        weight: Scale of shape (hidden,).
        eps: Added to the mean square before the square root.
        zero_centered_weight: Use ``1 + weight`` as the scale.
        rows_per_tile: Rows per program, a power of two (``tile_rows`` by default; for benchmarks).
    """
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    block = next_power_of_2(n_cols)
    rows = tile_rows(block) if rows_per_tile is None else rows_per_tile
    if n_rows > 0:
        _rms_norm_forward_kernel[(triton.cdiv(n_rows, rows),)](
            x2,
            weight,
            y,
            rstd,
            x2.stride(0),
            y.stride(0),
            n_rows,
            n_cols,
            eps,
            **launch_options(
                ZERO_CENTERED=zero_centered_weight,
                ROWS=rows,
                BLOCK=block,
                num_warps=warps_for_block(rows * block),
            ),
        )
    return y.view(x.shape), rstd.view(x.shape[:-1])


def add_rms_norm_forward(
    residual: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(residual + branch, rms_norm(residual + branch))`` from one kernel (no autograd)."""
    r2, b2 = _rows(residual), _rows(branch)
    n_rows, n_cols = r2.shape
    total = torch.empty((n_rows, n_cols), dtype=residual.dtype, device=residual.device)
    y = torch.empty_like(total)
    block = next_power_of_2(n_cols)
    rows = tile_rows(block)
    if n_rows > 0:
        _add_rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            r2,
            b2,
            weight,
            total,
            y,
            r2.stride(0),
            b2.stride(0),
            n_rows,
            n_cols,
            eps,
            **launch_options(
                ZERO_CENTERED=zero_centered_weight,
                ROWS=rows,
                BLOCK=block,
                num_warps=warps_for_block(rows * block),
            ),
        )
    return total.view(residual.shape), y.view(residual.shape)


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_weight: bool,
    *,
    rows_per_tile: int | None = None,
    programs_per_sm: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(dx, dweight)``; dweight is reduced over rows from per-program fp32 partial sums.

    Args:
        dy: Gradient of the output, shaped like ``x``.
        x: The forward's input.
        weight: The forward's scale.
        rstd: The forward's fp32 reciprocal RMS per row.
        zero_centered_weight: Whether the forward used ``1 + weight``.
        rows_per_tile: Rows per tile, a power of two (``backward_launch``'s by default; for tests).
        programs_per_sm: Persistent programs per multiprocessor (``backward_launch``'s by default).
    """
    x2, dy2 = _rows(x), _rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    block = next_power_of_2(n_cols)
    launch = backward_launch("rms_norm", block)
    if rows_per_tile is not None or programs_per_sm is not None:
        launch = replace(
            launch,
            rows=rows_per_tile or launch.rows,
            programs_per_sm=programs_per_sm or launch.programs_per_sm,
        )
    rows = launch.rows
    tiles = triton.cdiv(n_rows, rows)
    programs = min(tiles, multiprocessor_count(x.device) * launch.programs_per_sm)
    # Every program stores its partial (zeros if it had no tile), so the buffer needs no memset.
    dw_partial = torch.empty((1, programs, n_cols), dtype=torch.float32, device=x.device)
    _rms_norm_backward_kernel[(programs,)](
        dy2,
        x2,
        weight,
        rstd.reshape(-1),
        dx,
        dw_partial,
        dy2.stride(0),
        x2.stride(0),
        dx.stride(0),
        n_rows,
        n_cols,
        triton.cdiv(tiles, programs),
        **launch_options(
            ZERO_CENTERED=zero_centered_weight,
            ROWS=rows,
            BLOCK=block,
            num_warps=launch.warps,
        ),
    )
    (dw,) = sum_partials(dw_partial, (weight.dtype,))
    return dx.view(x.shape), dw
