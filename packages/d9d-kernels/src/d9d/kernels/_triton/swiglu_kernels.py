# pyright: basic
# ruff: noqa: N803 (Triton's convention: compile-time constants are UPPER_CASE)
# Triton's language module is untyped (its builtins erase types), so strict checking of kernel bodies
# reports every expression; the launch wrappers below still carry full annotations.
"""SwiGLU forward and backward Triton kernels (rows of a 2-D view, last dim contiguous)."""

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from d9d.kernels._triton.launch import interpreted, launch_options


def _configs() -> list[triton.Config]:
    if interpreted():
        return [triton.Config({"BLOCK": 64}, num_warps=4)]
    return [triton.Config({"BLOCK": b}, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8)]


@triton.autotune(configs=_configs(), key=["n_cols"], cache_results=True)
@triton.jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_configs(), key=["n_cols"], cache_results=True)
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


def _grid(n_rows: int, n_cols: int) -> Callable[[dict[str, Any]], tuple[int, int]]:
    return lambda meta: (n_rows, triton.cdiv(n_cols, meta["BLOCK"]))


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, stored in ``gate``'s dtype."""
    g2, u2 = _rows(gate), _rows(up)
    n_rows, n_cols = g2.shape
    out = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    if out.numel() > 0:
        _swiglu_forward_kernel[_grid(n_rows, n_cols)](
            g2, u2, out, g2.stride(0), u2.stride(0), n_cols, **launch_options()
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
    if dgate.numel() > 0:
        _swiglu_backward_kernel[_grid(n_rows, n_cols)](
            d2, g2, u2, dgate, dup, d2.stride(0), g2.stride(0), u2.stride(0), n_cols, **launch_options()
        )
    return dgate.view(gate.shape), dup.view(up.shape)
