"""SwiGLU forward and backward Triton kernels (rows of a 2-D view, last dim contiguous)."""

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import next_power_of_2

_MAX_BLOCK = 4096


@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    dout_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    stride_dout,
    stride_gate,
    stride_up,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dout = tl.load(dout_ptr + row * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dgate = dout * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dgate_ptr + row * n_cols + cols, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + row * n_cols + cols, (dout * silu).to(dup_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() > 0 else t.reshape(1, 1)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int]:
    block = min(next_power_of_2(n_cols), _MAX_BLOCK)
    return (n_rows, triton.cdiv(n_cols, block)), block


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, stored in ``gate``'s dtype."""
    g2, u2 = _rows(gate), _rows(up)
    n_rows, n_cols = g2.shape
    out = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    grid, block = _grid(n_rows, n_cols)
    if out.numel() > 0:
        _swiglu_forward_kernel[grid](
            g2, u2, out, g2.stride(0), u2.stride(0), n_cols, BLOCK=block, num_warps=8
        )
    return out.view(gate.shape)


def swiglu_backward(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(dgate, dup)``, recomputing ``silu(gate)`` from the saved inputs."""
    d2, g2, u2 = _rows(dout), _rows(gate), _rows(up)
    n_rows, n_cols = g2.shape
    dgate = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    dup = torch.empty((n_rows, n_cols), dtype=up.dtype, device=up.device)
    grid, block = _grid(n_rows, n_cols)
    if dgate.numel() > 0:
        _swiglu_backward_kernel[grid](
            d2, g2, u2, dgate, dup, d2.stride(0), g2.stride(0), u2.stride(0), n_cols, BLOCK=block, num_warps=8
        )
    return dgate.view(gate.shape), dup.view(up.shape)
