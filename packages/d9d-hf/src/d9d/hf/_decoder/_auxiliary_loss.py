"""The MoE load-balancing loss of a decoder model, carried from stage to stage and weighted like the loss.

Each sparse layer hands over ``router_aux_loss_coef * switch_loss`` of the microbatch; a stage adds
its layers' share to the ``load_balancing_loss`` entry of the hand-off (``(batch,)`` rows summing
to the total, so the pipeline transports it, and its gradient, like any activation), and the last
stage attaches the total to the head's output. The causal-LM head attaches it to the target
tokens' losses, so the training loss (their mean) has the gradient of ``loss + aux``: the auxiliary
loss gets the microbatch's weight like the main loss, and its share no longer depends on the
number of microbatches per rank or on the data-parallel size.
"""

from __future__ import annotations

from typing import Any

import torch

LOAD_BALANCING_KEY = "load_balancing_loss"
"""Hand-off entry: ``(batch,)`` rows whose sum is the microbatch's load-balancing loss so far."""


def add_stage_share(rows: torch.Tensor | None, share: torch.Tensor | None, batch: int) -> torch.Tensor:
    """The hand-off rows after a stage: the previous rows plus ``share`` spread over ``batch`` rows."""
    if rows is None:
        device = share.device if share is not None else None
        rows = torch.zeros(batch, dtype=torch.float32, device=device)
    if share is None:
        return rows
    return rows + (share.to(torch.float32) / batch).expand(batch)


class _AttachToTargets(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, output: torch.Tensor, auxiliary: torch.Tensor, targets: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(targets)
        ctx.auxiliary_dtype = auxiliary.dtype
        ctx.auxiliary_device = auxiliary.device
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (targets,) = ctx.saved_tensors
        grad = grad_outputs[0]
        if targets is None:  # weight 1, as if added to the final loss
            auxiliary_grad = torch.ones((), dtype=ctx.auxiliary_dtype, device=ctx.auxiliary_device)
        else:
            auxiliary_grad = (grad * targets.to(grad.dtype)).sum().to(ctx.auxiliary_dtype)
        return grad, auxiliary_grad, None


def attach_to_target_losses(
    losses: torch.Tensor, auxiliary: torch.Tensor, targets: torch.Tensor | None
) -> torch.Tensor:
    """Returns ``losses`` unchanged; backward treats every target token's loss as having ``+ auxiliary``.

    For a loss that is the mean of ``losses`` over the target tokens, the gradient is that of
    ``mean + auxiliary``, whatever weight the training loop gives the microbatch.

    Args:
        losses: Per-token losses ``(batch, seq)``, zero where there is no target.
        auxiliary: The scalar auxiliary loss.
        targets: ``(batch, seq)`` bool, True where a token has a target; None gives the
            auxiliary loss weight 1 (as if added to whatever final loss depends on ``losses``).
    """
    result = _AttachToTargets.apply(losses, auxiliary, targets)
    if not isinstance(result, torch.Tensor):
        raise TypeError("auxiliary loss attachment returned no tensor")
    return result
