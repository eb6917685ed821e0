"""``qk_norm_rope`` with gradients: custom ops under torch.compile, an autograd function in eager mode."""

from typing import Any

import torch

from d9d.kernels._triton.backward_node import run_backward_kernels


@torch.library.custom_op("d9d_kernels::qk_norm_rope_forward", mutates_args=())
def _forward(
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    zero_centered: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.qk_norm_rope_kernels import qk_norm_rope_kernel

    return qk_norm_rope_kernel(query, key, q_weight, k_weight, cos, sin, eps, zero_centered, interleaved)


@_forward.register_fake
def _forward_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    zero_centered: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(query, memory_format=torch.contiguous_format),
        torch.empty_like(key, memory_format=torch.contiguous_format),
    )


@torch.library.custom_op("d9d_kernels::qk_norm_rope_backward", mutates_args=())
def _backward_op(
    grad_query: torch.Tensor,
    grad_key: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    zero_centered: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.qk_norm_rope_kernels import qk_norm_rope_backward

    return qk_norm_rope_backward(
        grad_query, grad_key, query, key, q_weight, k_weight, cos, sin, eps, zero_centered, interleaved
    )


@_backward_op.register_fake
def _backward_fake(
    grad_query: torch.Tensor,
    grad_key: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    zero_centered: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(query, memory_format=torch.contiguous_format),
        torch.empty_like(key, memory_format=torch.contiguous_format),
        torch.empty_like(q_weight),
        torch.empty_like(k_weight),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    query, key, q_weight, k_weight, cos, sin, eps, zero_centered, interleaved = inputs
    ctx.save_for_backward(query, key, q_weight, k_weight, cos, sin)
    ctx.options = (eps, zero_centered, interleaved)


def _backward(ctx: Any, grad_query: torch.Tensor, grad_key: torch.Tensor) -> tuple[Any, ...]:
    gradients = _backward_op(grad_query, grad_key, *ctx.saved_tensors, *ctx.options)
    return (*gradients, None, None, None, None, None)


_forward.register_autograd(_backward, setup_context=_setup_context)


class _QKNormRopeFunction(torch.autograd.Function):
    """The same kernels in eager mode, without the custom-op dispatch overhead."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
        zero_centered: bool,
        interleaved: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from d9d.kernels._triton.qk_norm_rope_kernels import qk_norm_rope_kernel

        ctx.save_for_backward(query, key, q_weight, k_weight, cos, sin)
        ctx.options = (eps, zero_centered, interleaved)
        return qk_norm_rope_kernel(query, key, q_weight, k_weight, cos, sin, eps, zero_centered, interleaved)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        from d9d.kernels._triton.qk_norm_rope_kernels import qk_norm_rope_backward

        grad_query, grad_key = grad_outputs
        gradients = run_backward_kernels(
            "qk_norm_rope", qk_norm_rope_backward, grad_query, grad_key, *ctx.saved_tensors, *ctx.options
        )
        return (*gradients, None, None, None, None, None)


def qk_norm_rope_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    zero_centered: bool,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rope`` through the Triton kernels, differentiable in the queries, keys and weights.

    The custom ops under torch.compile, an ``autograd.Function`` over the same kernels in eager mode.
    The tables get no gradient.
    """
    args = (query, key, q_weight, k_weight, cos, sin, eps, zero_centered, interleaved)
    if torch.compiler.is_compiling():
        return _forward(*args)
    return _QKNormRopeFunction.apply(*args)
