"""RMSNorm as ``torch.library`` custom ops with autograd (opaque to torch.compile, traced around).

In eager mode the same kernels run through a ``torch.autograd.Function`` instead: the custom-op
dispatcher (op, Python autograd wrapper, backward op) costs more host time per call than the
kernels take on the GPU for a small norm such as Qwen3's qk-norm.
"""

from typing import Any

import torch

from d9d.kernels._triton.backward_node import run_backward_kernels


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


class _RmsNormFunction(torch.autograd.Function):
    """The same kernels for eager mode, without the custom-op dispatch overhead."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_weight: bool
    ) -> torch.Tensor:
        from d9d.kernels._triton.rms_norm_kernels import rms_norm_forward

        y, rstd = rms_norm_forward(x, weight, eps, zero_centered_weight)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered_weight = zero_centered_weight
        return y

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        from d9d.kernels._triton.rms_norm_kernels import rms_norm_backward

        (dy,) = grad_outputs
        x, weight, rstd = ctx.saved_tensors
        dx, dw = run_backward_kernels(
            "rms_norm", rms_norm_backward, dy.contiguous(), x, weight, rstd, ctx.zero_centered_weight
        )
        return dx, dw, None, None


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_weight: bool
) -> torch.Tensor:
    """RMSNorm through the Triton kernels; see ``d9d.kernels.rms_norm``.

    The custom op under torch.compile, an ``autograd.Function`` over the same kernels in eager mode.
    """
    if torch.compiler.is_compiling():
        y, _ = _forward(x, weight, eps, zero_centered_weight)
        return y
    return _RmsNormFunction.apply(x, weight, eps, zero_centered_weight)
