"""Rotary embedding as ``torch.library`` custom ops with autograd (no gradient for cos / sin).

In eager mode the same kernel runs through a ``torch.autograd.Function``, which costs less host
time per call than the custom-op dispatcher.
"""

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


class _RopeFunction(torch.autograd.Function):
    """The same kernel for eager mode; its backward is the transposed rotation, itself differentiable."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool
    ) -> torch.Tensor:
        from d9d.kernels._triton.rope_kernels import apply_rope_kernel

        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        ctx.backward = backward
        return apply_rope_kernel(x, cos, sin, interleaved, backward)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        (dy,) = grad_outputs
        cos, sin = ctx.saved_tensors
        dx = _RopeFunction.apply(dy, cos, sin, ctx.interleaved, not ctx.backward)
        return dx, None, None, None, None


def apply_rope_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding through the Triton kernel; see ``d9d.kernels.apply_rope``.

    The custom op under torch.compile, an ``autograd.Function`` over the same kernel in eager mode.
    """
    if torch.compiler.is_compiling():
        return _rope(x, cos, sin, interleaved, False)
    return _RopeFunction.apply(x, cos, sin, interleaved, False)
