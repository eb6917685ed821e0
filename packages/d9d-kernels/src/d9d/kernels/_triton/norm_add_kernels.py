# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""A normalized branch joining the residual stream, and the norm after it, in one pass per direction.

Post-norm layouts (Gemma 3's four norms a layer, OLMo 2's two) compute ``total = residual +
scale * rms_norm(branch)`` and, in Gemma's sandwich, ``rms_norm(total)`` for the feed-forward right
after. Each row is held in registers once: the forward reads the residual and the branch and writes
the stream and the next norm's input; the backward reads the stream's gradient, the next norm's
output gradient, the stream and the branch, and writes the gradients of the residual and the
branch, with both weights' gradients summed per program on the way. Inductor's code for the same
graph, at widths above 1024 (Gemma-3-1B's 1152), loops over each row once per reduction and
reduces the weight gradients over rows in kernels of their own.
"""

from typing import Any

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import launch_options, next_power_of_2, warps_for_block
from d9d.kernels._triton.rms_norm_kernels import (
    _input_gradient,
    _tile,
    backward_launch,
    multiprocessor_count,
    sum_partials,
    tile_rows,
)


@triton.jit
def _scale_of(w_ptr, cols, col_mask, ZERO_CENTERED: tl.constexpr):
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    return w


@triton.jit
def _norm_add_forward_kernel(
    residual_ptr,
    branch_ptr,
    w_branch_ptr,
    w_next_ptr,
    total_ptr,
    y_ptr,
    rstd_branch_ptr,
    rstd_total_ptr,
    stride_residual,
    stride_branch,
    n_rows,
    n_cols,
    eps_branch,
    eps_next,
    scale,
    ZERO_CENTERED_BRANCH: tl.constexpr,
    ZERO_CENTERED_NEXT: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, cols, row_mask, col_mask, mask = _tile(tl.program_id(0), n_rows, n_cols, ROWS, BLOCK)
    dtype = total_ptr.dtype.element_ty
    branch = tl.load(branch_ptr + rows[:, None] * stride_branch + cols[None, :], mask=mask, other=0.0)
    branch = branch.to(tl.float32)
    rstd_branch = tl.rsqrt(tl.sum(branch * branch, axis=1) / n_cols + eps_branch)
    w_branch = _scale_of(w_branch_ptr, cols, col_mask, ZERO_CENTERED_BRANCH)
    # rounded where the unfused ops store: the norm's output, the scaled branch, the sum
    normed = (branch * rstd_branch[:, None] * w_branch[None, :]).to(dtype)
    if SCALED:
        normed = (normed.to(tl.float32) * scale).to(dtype)
    residual = tl.load(residual_ptr + rows[:, None] * stride_residual + cols[None, :], mask=mask, other=0.0)
    total = (residual.to(tl.float32) + normed.to(tl.float32)).to(dtype)
    out = rows[:, None] * n_cols + cols[None, :]
    tl.store(total_ptr + out, total, mask=mask)
    tl.store(rstd_branch_ptr + rows, rstd_branch, mask=row_mask)
    if HAS_NEXT:
        t = total.to(tl.float32)
        rstd_total = tl.rsqrt(tl.sum(t * t, axis=1) / n_cols + eps_next)
        w_next = _scale_of(w_next_ptr, cols, col_mask, ZERO_CENTERED_NEXT)
        tl.store(y_ptr + out, (t * rstd_total[:, None] * w_next[None, :]).to(dtype), mask=mask)
        tl.store(rstd_total_ptr + rows, rstd_total, mask=row_mask)


@triton.jit
def _norm_add_backward_kernel(
    dtotal_ptr,
    dy_ptr,
    total_ptr,
    branch_ptr,
    w_branch_ptr,
    w_next_ptr,
    rstd_branch_ptr,
    rstd_total_ptr,
    dresidual_ptr,
    dbranch_ptr,
    dw_branch_partial_ptr,
    dw_next_partial_ptr,
    stride_branch,
    n_rows,
    n_cols,
    tiles_per_program,
    scale,
    ZERO_CENTERED_BRANCH: tl.constexpr,
    ZERO_CENTERED_NEXT: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    dtype = dresidual_ptr.dtype.element_ty
    w_branch = _scale_of(w_branch_ptr, cols, col_mask, ZERO_CENTERED_BRANCH)
    dw_branch_acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    if HAS_NEXT:
        w_next = _scale_of(w_next_ptr, cols, col_mask, ZERO_CENTERED_NEXT)
        dw_next_acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for i in range(0, tiles_per_program):
        # Tiles are dealt round-robin; past the last tile every row is masked (no memory traffic).
        rows, _, row_mask, _, mask = _tile(pid + i * programs, n_rows, n_cols, ROWS, BLOCK)
        at = rows[:, None] * n_cols + cols[None, :]
        dtotal = tl.load(dtotal_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if HAS_NEXT:
            t = tl.load(total_ptr + at, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
            rstd_total = tl.load(rstd_total_ptr + rows, mask=row_mask, other=0.0)
            t_hat = t * rstd_total[:, None]
            # the next norm's input gradient, added to the stream's in the stream's dtype, as autograd sums
            dnext = _input_gradient(t_hat, w_next[None, :] * dy, rstd_total, n_cols).to(dtype)
            dtotal = (dtotal + dnext.to(tl.float32)).to(dtype).to(tl.float32)
            dw_next_acc += dy * t_hat
        tl.store(dresidual_ptr + at, dtotal.to(dtype), mask=mask)
        dnormed = dtotal
        if SCALED:
            dnormed = (dnormed * scale).to(dtype).to(tl.float32)
        branch = tl.load(branch_ptr + rows[:, None] * stride_branch + cols[None, :], mask=mask, other=0.0)
        rstd_branch = tl.load(rstd_branch_ptr + rows, mask=row_mask, other=0.0)
        b_hat = branch.to(tl.float32) * rstd_branch[:, None]
        dbranch = _input_gradient(b_hat, w_branch[None, :] * dnormed, rstd_branch, n_cols)
        tl.store(dbranch_ptr + at, dbranch.to(dtype), mask=mask)
        dw_branch_acc += dnormed * b_hat
    partial = pid.to(tl.int64) * n_cols + cols
    tl.store(dw_branch_partial_ptr + partial, tl.sum(dw_branch_acc, axis=0), mask=col_mask)
    if HAS_NEXT:
        tl.store(dw_next_partial_ptr + partial, tl.sum(dw_next_acc, axis=0), mask=col_mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _options(
    block: int,
    rows: int,
    warps: int,
    zero_centered_weight: bool,
    next_zero_centered_weight: bool,
    scale: float,
    has_next: bool,
) -> dict[str, Any]:
    """The constexprs and warps of a kernel of either direction over tiles of ``rows`` x ``block``."""
    return launch_options(
        ZERO_CENTERED_BRANCH=zero_centered_weight,
        ZERO_CENTERED_NEXT=next_zero_centered_weight,
        SCALED=scale != 1.0,
        HAS_NEXT=has_next,
        ROWS=rows,
        BLOCK=block,
        num_warps=warps,
    )


def norm_add_forward(
    residual: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
    next_eps: float,
    scale: float,
    zero_centered_weight: bool,
    next_zero_centered_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(total, y, rstd_branch, rstd_total)``.

    ``total = residual + scale * rms_norm(branch, weight)`` and ``y = rms_norm(total, next_weight)``;
    without ``next_weight``, ``y`` and ``rstd_total`` are empty.
    """
    r2, b2 = _rows(residual), _rows(branch)
    n_rows, n_cols = r2.shape
    has_next = next_weight is not None
    total = torch.empty((n_rows, n_cols), dtype=residual.dtype, device=residual.device)
    y = torch.empty_like(total) if has_next else total.new_empty((0,))
    rstd_branch = torch.empty((n_rows,), dtype=torch.float32, device=residual.device)
    rstd_total = torch.empty_like(rstd_branch) if has_next else rstd_branch.new_empty((0,))
    block = next_power_of_2(n_cols)
    rows = tile_rows(block)
    options = _options(
        block,
        rows,
        warps_for_block(rows * block),
        zero_centered_weight,
        next_zero_centered_weight,
        scale,
        has_next,
    )
    if n_rows > 0:
        _norm_add_forward_kernel[(triton.cdiv(n_rows, rows),)](
            r2,
            b2,
            weight,
            weight if next_weight is None else next_weight,
            total,
            y,
            rstd_branch,
            rstd_total,
            r2.stride(0),
            b2.stride(0),
            n_rows,
            n_cols,
            eps,
            next_eps,
            scale,
            **options,
        )
    shape = residual.shape
    return total.view(shape), y.view(shape) if has_next else y, rstd_branch, rstd_total


def norm_add_backward(
    dtotal: torch.Tensor,
    dy: torch.Tensor | None,
    total: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    rstd_branch: torch.Tensor,
    rstd_total: torch.Tensor,
    scale: float,
    zero_centered_weight: bool,
    next_zero_centered_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns ``(dresidual, dbranch, dweight, dnext_weight)`` (``dnext_weight`` None without a next norm).

    ``dtotal`` is the stream's gradient from its other uses, ``dy`` the next norm's output gradient
    (None, or without a next norm: not added).
    """
    has_next = next_weight is not None
    d2 = dtotal.reshape(-1, dtotal.shape[-1]).contiguous()
    b2 = _rows(branch)
    n_rows, n_cols = d2.shape
    dresidual = torch.empty_like(d2)
    dbranch = torch.empty((n_rows, n_cols), dtype=branch.dtype, device=branch.device)
    if n_rows == 0:
        dnext = torch.zeros_like(next_weight) if next_weight is not None else None
        return dresidual.view(dtotal.shape), dbranch.view(branch.shape), torch.zeros_like(weight), dnext
    if has_next and dy is None:
        dy = torch.zeros_like(d2)
    dy2 = d2 if dy is None else dy.reshape(-1, n_cols).contiguous()
    t2 = total.reshape(-1, n_cols).contiguous()
    block = next_power_of_2(n_cols)
    launch = backward_launch("rms_norm_add_next" if has_next else "rms_norm_add", block)
    options = _options(
        block, launch.rows, launch.warps, zero_centered_weight, next_zero_centered_weight, scale, has_next
    )
    tiles = triton.cdiv(n_rows, launch.rows)
    programs = min(tiles, multiprocessor_count(d2.device) * launch.programs_per_sm)
    # Every program stores its partials (zeros if it had no tile), so the buffers need no memset.
    partials = torch.empty((2 if has_next else 1, programs, n_cols), dtype=torch.float32, device=d2.device)
    _norm_add_backward_kernel[(programs,)](
        d2,
        dy2,
        t2,
        b2,
        weight,
        weight if next_weight is None else next_weight,
        rstd_branch,
        rstd_total if has_next else rstd_branch,
        dresidual,
        dbranch,
        partials[0],
        partials[-1],
        b2.stride(0),
        n_rows,
        n_cols,
        triton.cdiv(tiles, programs),
        scale,
        **options,
    )
    if next_weight is None:
        (dweight,), dnext_weight = sum_partials(partials, (weight.dtype,)), None
    else:
        dweight, dnext_weight = sum_partials(partials, (weight.dtype, next_weight.dtype))
    return dresidual.view(dtotal.shape), dbranch.view(branch.shape), dweight, dnext_weight
