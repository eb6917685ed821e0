"""Fused linear cross-entropy as ``torch.library`` custom ops with autograd."""

from typing import Any

import torch

UNIFORM_NONE = "none_uniform"
"""Internal reduction: per-token losses whose gradients the forward computes (one upstream weight)."""


def _reduce(loss: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    match reduction:
        case "none" | "none_uniform":
            return loss
        case "sum":
            return loss.sum()
        case "mean":
            return loss.sum() / count
        case _:
            raise ValueError(f"linear_cross_entropy: reduction={reduction!r} is not 'mean', 'sum' or 'none'")


def _forward_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    reduction: str,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.linear_cross_entropy_kernels import linear_cross_entropy_forward

    count = (labels != ignore_index).sum().clamp(min=1).float()
    # Gradients computed here are those of the reduced loss ("none_uniform": of the sum); "none"
    # computes them in the backward.
    grad_scale = (1.0 / count if reduction == "mean" else torch.ones_like(count)).reshape(1)
    loss, lse, hidden_grad, weight_grad = linear_cross_entropy_forward(
        hidden.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index, grad_scale,
        need_hidden_grad, need_weight_grad, chunk_size,
    )  # fmt: skip
    return _reduce(loss, count, reduction), lse, hidden_grad, weight_grad


@torch.library.custom_op("d9d_kernels::linear_cross_entropy_forward", mutates_args=())
def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    reduction: str,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(
        hidden, weight, labels, ignore_index, reduction, need_hidden_grad, need_weight_grad, chunk_size
    )


@_forward.register_fake
def _forward_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    reduction: str,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = hidden.shape[0]
    loss = hidden.new_empty((n,) if reduction in ("none", UNIFORM_NONE) else (), dtype=torch.float32)
    lse = hidden.new_empty((n,), dtype=torch.float32)
    hidden_grad = torch.empty_like(hidden) if need_hidden_grad else hidden.new_empty((0,))
    weight_grad = torch.empty_like(weight) if need_weight_grad else weight.new_empty((0,))
    return loss, lse, hidden_grad, weight_grad


@torch.library.custom_op("d9d_kernels::linear_cross_entropy_backward", mutates_args=())
def _backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    ignore_index: int,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from d9d.kernels._triton.linear_cross_entropy_kernels import linear_cross_entropy_backward

    return linear_cross_entropy_backward(
        hidden.contiguous(), weight.contiguous(), labels.contiguous(), lse, grad_loss, ignore_index,
        need_hidden_grad, need_weight_grad, chunk_size,
    )  # fmt: skip


@_backward_op.register_fake
def _backward_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    ignore_index: int,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden_grad = torch.empty_like(hidden) if need_hidden_grad else hidden.new_empty((0,))
    weight_grad = torch.empty_like(weight) if need_weight_grad else weight.new_empty((0,))
    return hidden_grad, weight_grad


def _scale(t: torch.Tensor, scale: torch.Tensor, eager: bool) -> None:
    """``t *= scale`` (a one-element device tensor): ``scale_in_place`` in eager mode; ``mul_`` in
    the op's backward, which ``torch.compile`` traces and Inductor fuses."""
    if eager:
        from d9d.kernels._triton.linear_cross_entropy_kernels import scale_in_place

        scale_in_place(t, scale)
    else:
        t.mul_(scale)


def _scale_in_place(
    hidden_grad: torch.Tensor,
    weight_grad: torch.Tensor,
    scale: torch.Tensor,
    need_h: bool,
    need_w: bool,
    eager: bool,
) -> None:
    if need_h:
        _scale(hidden_grad, scale, eager)
    if need_w:
        _scale(weight_grad, scale, eager)


def _scale_uniform_in_place(
    hidden_grad: torch.Tensor,
    weight_grad: torch.Tensor,
    grad_loss: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    need_h: bool,
    need_w: bool,
    eager: bool,
) -> None:
    """Scales gradients of the summed per-token losses by per-token upstream gradients ``grad_loss``.

    A token's hidden gradient depends on that token alone: scaling its row is exact for any
    upstream gradient. The weight gradient is a sum over tokens: scaling it by the mean upstream
    gradient over target tokens is exact when that gradient is the same at every target token.
    """
    grad = grad_loss.reshape(-1).to(torch.float32)
    if need_h:
        hidden_grad.mul_(grad.unsqueeze(1).to(hidden_grad.dtype))
    if need_w:
        targets = labels != ignore_index
        mean = (grad * targets).sum() / targets.sum().clamp(min=1)
        _scale(weight_grad, mean.to(weight_grad.dtype), eager)


def _input_gradients(
    hidden_grad: torch.Tensor, weight_grad: torch.Tensor, need_h: bool, need_w: bool
) -> tuple[torch.Tensor | None, ...]:
    """Gradients for (hidden, weight, labels, ignore_index, reduction, chunk_size, need_h, need_w)."""
    return (hidden_grad if need_h else None, weight_grad if need_w else None, *(None,) * 6)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, labels, ignore_index, reduction, need_hidden_grad, need_weight_grad, chunk_size = inputs
    _, lse, hidden_grad, weight_grad = output
    ctx.save_for_backward(hidden, weight, labels, lse, hidden_grad, weight_grad)
    ctx.ignore_index = ignore_index
    ctx.reduction = reduction
    ctx.need_hidden_grad = need_hidden_grad
    ctx.need_weight_grad = need_weight_grad
    ctx.chunk_size = chunk_size


def _backward(ctx: Any, grad_loss: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
    hidden, weight, labels, lse, hidden_grad, weight_grad = ctx.saved_tensors
    if ctx.reduction == "none":
        need_h = bool(ctx.needs_input_grad[0])
        need_w = bool(ctx.needs_input_grad[1])
        hidden_grad, weight_grad = _backward_op(
            hidden, weight, labels, lse, grad_loss, ctx.ignore_index, need_h, need_w, ctx.chunk_size
        )
    elif ctx.reduction == UNIFORM_NONE:
        need_h, need_w = ctx.need_hidden_grad, ctx.need_weight_grad
        _scale_uniform_in_place(
            hidden_grad, weight_grad, grad_loss, labels, ctx.ignore_index, need_h, need_w, eager=False
        )
    else:
        # The forward computed the gradients of the reduced loss; scale them by the upstream scalar
        # in place (the saved tensors are ours alone; a second backward fails the version check).
        need_h, need_w = ctx.need_hidden_grad, ctx.need_weight_grad
        _scale_in_place(hidden_grad, weight_grad, grad_loss.to(hidden.dtype), need_h, need_w, eager=False)
    return _input_gradients(hidden_grad, weight_grad, need_h, need_w)


_forward.register_autograd(_backward, setup_context=_setup_context)


class _LinearCrossEntropyFunction(torch.autograd.Function):
    """The eager path: the same kernels without custom-op dispatch, and without the op's extra
    references to the gradients, so autograd can adopt them as ``.grad`` without a copy."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        reduction: str,
        chunk_size: int,
        need_h: bool,
        need_w: bool,
    ) -> torch.Tensor:
        loss, lse, hidden_grad, weight_grad = _forward_impl(
            hidden, weight, labels, ignore_index, reduction, need_h, need_w, chunk_size
        )
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.grads = (hidden_grad, weight_grad)
        ctx.args = (ignore_index, reduction, need_h, need_w, chunk_size)
        return loss

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        (grad_loss,) = grad_outputs
        from d9d.kernels._triton.linear_cross_entropy_kernels import linear_cross_entropy_backward

        hidden, weight, labels, lse = ctx.saved_tensors
        ignore_index, reduction, need_h, need_w, chunk_size = ctx.args
        if reduction == "none":
            need_h, need_w = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
            hidden_grad, weight_grad = linear_cross_entropy_backward(
                hidden, weight, labels, lse, grad_loss, ignore_index, need_h, need_w, chunk_size
            )
        elif reduction == UNIFORM_NONE:
            hidden_grad, weight_grad = ctx.grads
            ctx.grads = None  # hand the only references to autograd
            _scale_uniform_in_place(
                hidden_grad, weight_grad, grad_loss, labels, ignore_index, need_h, need_w, eager=True
            )
        else:
            hidden_grad, weight_grad = ctx.grads
            ctx.grads = None  # hand the only references to autograd
            _scale_in_place(hidden_grad, weight_grad, grad_loss.to(hidden.dtype), need_h, need_w, eager=True)
        return _input_gradients(hidden_grad, weight_grad, need_h, need_w)


def linear_cross_entropy_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
) -> torch.Tensor:
    """Linear cross-entropy through the chunked kernels; see ``d9d.kernels.linear_cross_entropy``."""
    grad_on = torch.is_grad_enabled() and reduction != "none"
    if not torch.compiler.is_compiling():
        return _LinearCrossEntropyFunction.apply(
            hidden, weight, labels, ignore_index, reduction, chunk_size,
            grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
        )  # fmt: skip
    loss, _, _, _ = _forward(
        hidden, weight, labels, ignore_index, reduction,
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad, chunk_size,
    )  # fmt: skip
    return loss
