"""RMSNorm as ``torch.library`` custom ops with autograd (opaque to torch.compile, traced around)."""

from typing import Any

import torch


@torch.library.custom_op("d9d_kernels::rms_norm_forward", mutates_args=())
def _forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.rms_norm_kernels import rms_norm_forward

    return rms_norm_forward(x, weight, eps, zero_centered_weight)


@_forward.register_fake
def _forward_fake(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        x.shape[:-1], dtype=torch.float32
    )


@torch.library.custom_op("d9d_kernels::rms_norm_backward", mutates_args=())
def _backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, zero_centered_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.rms_norm_kernels import rms_norm_backward

    return rms_norm_backward(dy, x, weight, rstd, zero_centered_weight)


@_backward_op.register_fake
def _backward_fake(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, zero_centered_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, _, zero_centered_weight = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.zero_centered_weight = zero_centered_weight


def _backward(ctx: Any, dy: torch.Tensor, _drstd: torch.Tensor | None) -> tuple[Any, ...]:
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _backward_op(dy.contiguous(), x, weight, rstd, ctx.zero_centered_weight)
    return dx, dw, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_weight: bool
) -> torch.Tensor:
    """RMSNorm through the Triton kernels; see ``d9d.kernels.rms_norm``."""
    y, _ = _forward(x, weight, eps, zero_centered_weight)
    return y
