"""SwiGLU as ``torch.library`` custom ops with autograd."""

from typing import Any

import torch

from d9d.kernels._triton.backward_node import run_backward_kernels


@torch.library.custom_op("d9d_kernels::swiglu_forward", mutates_args=())
def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from d9d.kernels._triton.swiglu_kernels import swiglu_forward

    return swiglu_forward(gate, up)


@_forward.register_fake
def _forward_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("d9d_kernels::swiglu_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.swiglu_kernels import swiglu_backward

    return swiglu_backward(dout, gate, up)


@_backward_op.register_fake
def _backward_fake(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(gate, memory_format=torch.contiguous_format),
        torch.empty_like(up, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])


def _backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = ctx.saved_tensors
    return _backward_op(dout, gate, up)


_forward.register_autograd(_backward, setup_context=_setup_context)


class _SwigluFunction(torch.autograd.Function):
    """The same kernels for eager mode, without the custom-op dispatch overhead."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        from d9d.kernels._triton.swiglu_kernels import swiglu_forward

        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        (dout,) = grad_outputs
        from d9d.kernels._triton.swiglu_kernels import swiglu_backward

        gate, up = ctx.saved_tensors
        return run_backward_kernels("swiglu", swiglu_backward, dout, gate, up)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU through the Triton kernels; see ``d9d.kernels.swiglu``.

    The custom op under torch.compile, an ``autograd.Function`` over the same kernels in eager mode.
    """
    if torch.compiler.is_compiling():
        return _forward(gate, up)
    return _SwigluFunction.apply(gate, up)
