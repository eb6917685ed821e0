"""``rms_norm_add`` as ``torch.library`` custom ops with autograd (opaque to torch.compile, traced around)."""

import math
from typing import Any

import torch

_Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("d9d_kernels::rms_norm_add_forward", mutates_args=())
def _forward(
    residual: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
    next_eps: float,
    scale: float,
    zero_centered_weight: bool,
    next_zero_centered_weight: bool,
) -> _Outputs:
    from d9d.kernels._triton.norm_add_kernels import norm_add_forward

    return norm_add_forward(
        residual,
        branch,
        weight,
        next_weight,
        eps,
        next_eps,
        scale,
        zero_centered_weight,
        next_zero_centered_weight,
    )


@_forward.register_fake
def _forward_fake(
    residual: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
    next_eps: float,
    scale: float,
    zero_centered_weight: bool,
    next_zero_centered_weight: bool,
) -> _Outputs:
    total = torch.empty_like(residual, memory_format=torch.contiguous_format)
    rstd_branch = residual.new_empty((math.prod(residual.shape[:-1]),), dtype=torch.float32)
    if next_weight is None:
        return total, residual.new_empty((0,)), rstd_branch, rstd_branch.new_empty((0,))
    return total, torch.empty_like(total), rstd_branch, torch.empty_like(rstd_branch)


@torch.library.custom_op("d9d_kernels::rms_norm_add_backward", mutates_args=())
def _backward_op(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.norm_add_kernels import norm_add_backward

    dresidual, dbranch, dweight, dnext = norm_add_backward(
        dtotal,
        dy,
        total,
        branch,
        weight,
        next_weight,
        rstd_branch,
        rstd_total,
        scale,
        zero_centered_weight,
        next_zero_centered_weight,
    )
    # a custom op returns tensors only: an empty one stands for "no next norm"
    return dresidual, dbranch, dweight, weight.new_empty((0,)) if dnext is None else dnext


@_backward_op.register_fake
def _backward_fake(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dnext = weight.new_empty((0,)) if next_weight is None else torch.empty_like(next_weight)
    return (
        torch.empty_like(dtotal, memory_format=torch.contiguous_format),
        torch.empty_like(branch, memory_format=torch.contiguous_format),
        torch.empty_like(weight),
        dnext,
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: _Outputs) -> None:
    _, branch, weight, next_weight, _, _, scale, zero_centered, next_zero_centered = inputs
    total, _, rstd_branch, rstd_total = output
    ctx.save_for_backward(total, branch, weight, next_weight, rstd_branch, rstd_total)
    ctx.scale = scale
    ctx.zero_centered = (zero_centered, next_zero_centered)


def _backward(
    ctx: Any,
    dtotal: torch.Tensor | None,
    dy: torch.Tensor | None,
    _drstd_branch: torch.Tensor | None,
    _drstd_total: torch.Tensor | None,
) -> tuple[Any, ...]:
    total, branch, weight, next_weight, rstd_branch, rstd_total = ctx.saved_tensors
    if dtotal is None:
        dtotal = torch.zeros_like(total)
    dresidual, dbranch, dweight, dnext = _backward_op(
        dtotal.contiguous(),
        None if dy is None or next_weight is None else dy.contiguous(),
        total,
        branch,
        weight,
        next_weight,
        rstd_branch,
        rstd_total,
        ctx.scale,
        *ctx.zero_centered,
    )
    return dresidual, dbranch, dweight, None if next_weight is None else dnext, None, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_add_triton(
    residual: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
    next_eps: float,
    scale: float,
    zero_centered_weight: bool,
    next_zero_centered_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rms_norm_add`` through the Triton kernels; see ``d9d.kernels.rms_norm_add``."""
    total, y, _, _ = _forward(
        residual,
        branch,
        weight,
        next_weight,
        eps,
        next_eps,
        scale,
        zero_centered_weight,
        next_zero_centered_weight,
    )
    return total, None if next_weight is None else y
