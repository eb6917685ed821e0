"""Grouped matmul: PyTorch's grouped GEMM where it applies, else Triton custom ops with autograd."""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


@torch.library.custom_op("d9d_kernels::grouped_mm", mutates_args=())
def _forward(
    x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.grouped_mm_kernels import group_offsets, grouped_mm_forward

    offsets = group_offsets(tokens_per_group)
    return grouped_mm_forward(x.contiguous(), weight, offsets), offsets


@_forward.register_fake
def _forward_fake(
    x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((x.shape[0], weight.shape[2])), tokens_per_group.new_empty(
        (tokens_per_group.shape[0] + 1,), dtype=torch.int32
    )


@torch.library.custom_op("d9d_kernels::grouped_mm_backward", mutates_args=())
def _backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    need_x: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.grouped_mm_kernels import grouped_mm_forward, grouped_mm_weight_grad

    dy = dy.contiguous()
    dx = grouped_mm_forward(dy, weight.transpose(1, 2), offsets) if need_x else x.new_empty((0,))
    dw = (
        grouped_mm_weight_grad(x.contiguous(), dy, offsets, weight.shape[0])
        if need_weight
        else x.new_empty((0,))
    )
    return dx, dw


@_backward_op.register_fake
def _backward_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    need_x: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if need_x else x.new_empty((0,))
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else x.new_empty((0,))
    return dx, dw


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx: Any, dy: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
    x, weight, offsets = ctx.saved_tensors
    need_x, need_weight = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
    dx, dw = _backward_op(dy, x, weight, offsets, need_x, need_weight)
    return (dx if need_x else None, dw if need_weight else None, None)


_forward.register_autograd(_backward, setup_context=_setup_context)


def _torch_grouped_mm() -> Callable[..., torch.Tensor] | None:
    function: Callable[..., torch.Tensor] | None = getattr(F, "grouped_mm", None)
    return function if function is not None else getattr(torch, "_grouped_mm", None)


def _fits_torch_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # CUTLASS grouped GEMM: bf16 on sm90+ with 16-byte aligned rows of both operands.
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and x.shape[1] % 8 == 0
        and weight.shape[2] % 8 == 0
        and _torch_grouped_mm() is not None
    )


def grouped_mm_triton(
    x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor, force_triton: bool
) -> torch.Tensor:
    """Grouped matmul on CUDA (or the Triton interpreter); see ``d9d.kernels.grouped_mm``."""
    torch_grouped_mm = _torch_grouped_mm()
    if not force_triton and torch_grouped_mm is not None and _fits_torch_grouped_mm(x, weight):
        offsets = torch.cumsum(tokens_per_group, dim=0, dtype=torch.int32)
        return torch_grouped_mm(x, weight, offs=offsets)
    out, _ = _forward(x, weight, tokens_per_group)
    return out
