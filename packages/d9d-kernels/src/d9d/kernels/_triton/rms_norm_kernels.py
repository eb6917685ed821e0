# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""RMSNorm forward and backward Triton kernels."""

import functools

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import launch_options, next_power_of_2, warps_for_block


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a small fixed count in Triton's CPU interpreter."""
    if device.type != "cuda":
        return 2
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    stride_x,
    stride_y,
    n_cols,
    eps,
    ZERO_CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    tl.store(y_ptr + row * stride_y + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


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
    rows_per_program,
    ZERO_CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        r = row_start + i
        row_mask = mask & (
            (cols * 0 + r) < n_rows
        )  # broadcast first: the interpreter rejects scalar & vector masks
        x = tl.load(x_ptr + r * stride_x + cols, mask=row_mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r * stride_dy + cols, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=r < n_rows, other=0.0)
        x_hat = x * rstd
        wdy = w * dy
        c = tl.sum(x_hat * wdy, axis=0) / n_cols
        dx = (wdy - x_hat * c) * rstd
        tl.store(dx_ptr + r * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
        dw_acc += dy * x_hat
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(y, rstd)``: the normalized rows and each row's fp32 reciprocal RMS."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    block = next_power_of_2(n_cols)
    if n_rows > 0:
        _rms_norm_forward_kernel[(n_rows,)](
            x2,
            weight,
            y,
            rstd,
            x2.stride(0),
            y.stride(0),
            n_cols,
            eps,
            **launch_options(
                ZERO_CENTERED=zero_centered_weight, BLOCK=block, num_warps=warps_for_block(block)
            ),
        )
    return y.view(x.shape), rstd.view(x.shape[:-1])


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, zero_centered_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(dx, dweight)``; dweight is reduced over rows from per-program fp32 partial sums."""
    x2, dy2 = _rows(x), _rows(dy)
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    # Several programs per multiprocessor keep enough loads in flight to saturate memory bandwidth.
    programs = max(1, min(n_rows, multiprocessor_count(x.device) * 4))
    rows_per_program = triton.cdiv(n_rows, programs) if n_rows > 0 else 1
    programs = triton.cdiv(n_rows, rows_per_program) if n_rows > 0 else 1
    dw_partial = torch.zeros((programs, n_cols), dtype=torch.float32, device=x.device)
    block = next_power_of_2(n_cols)
    if n_rows > 0:
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
            rows_per_program,
            **launch_options(
                ZERO_CENTERED=zero_centered_weight, BLOCK=block, num_warps=warps_for_block(block)
            ),
        )
    dw = dw_partial.sum(dim=0).to(weight.dtype)
    return dx.view(x.shape), dw
