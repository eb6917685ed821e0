"""Adding an auxiliary loss's gradient to the backward pass without changing a forward output."""

from __future__ import annotations

from typing import Any

import torch


class _AttachAuxiliaryLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor, coefficient: float) -> torch.Tensor:
        ctx.coefficient = coefficient
        ctx.loss_dtype = loss.dtype
        ctx.loss_device = loss.device
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        loss_grad = torch.full((), ctx.coefficient, dtype=ctx.loss_dtype, device=ctx.loss_device)
        return grad_outputs[0], loss_grad, None


def attach_auxiliary_loss(output: torch.Tensor, loss: torch.Tensor, coefficient: float) -> torch.Tensor:
    """Returns ``output`` unchanged; in backward, ``loss`` also receives gradient ``coefficient``.

    Equivalent to adding ``coefficient * loss`` to the final loss, for any final loss that depends on
    ``output``, without threading the auxiliary loss through the model's return values.
    """
    result = _AttachAuxiliaryLoss.apply(output, loss, coefficient)
    if not isinstance(result, torch.Tensor):
        raise TypeError("auxiliary loss attachment returned no tensor")
    return result
