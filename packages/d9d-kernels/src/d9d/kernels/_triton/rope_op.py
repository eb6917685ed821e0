"""Rotary embedding as ``torch.library`` custom ops with autograd (no gradient for cos / sin)."""

from typing import Any

import torch


@torch.library.custom_op("d9d_kernels::apply_rope", mutates_args=())
def _rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool
) -> torch.Tensor:
    from d9d.kernels._triton.rope_kernels import apply_rope_kernel

    return apply_rope_kernel(x, cos, sin, interleaved, backward)


@_rope.register_fake
def _rope_fake(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool
) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _, cos, sin, interleaved, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved = interleaved
    ctx.backward = backward


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    cos, sin = ctx.saved_tensors
    dx = _rope(dy, cos, sin, ctx.interleaved, not ctx.backward)
    return dx, None, None, None, None


_rope.register_autograd(_backward, setup_context=_setup_context)


def apply_rope_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding through the Triton kernel; see ``d9d.kernels.apply_rope``."""
    return _rope(x, cos, sin, interleaved, False)
