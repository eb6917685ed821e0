"""The MoE load-balancing loss of a decoder model, carried from stage to stage and weighted like the loss.

Each sparse layer hands over its routing's ``load_balancing_statistics`` of the microbatch (token
counts and score sums per expert, token count); a stage adds its layers' share to the
``load_balancing_statistics`` entry of the hand-off (``(batch, 2 * experts + 1)`` rows summing to
the total, so the pipeline transports it, and its gradient, like any activation), and the last
stage attaches ``coefficient * pooled_load_balancing_loss(total)`` to the head's output: one loss
pooled over every layer, as transformers' ``load_balancing_loss_func`` computes it. The causal-LM
head attaches it to the target tokens' losses, so the training loss (their mean) has the gradient
of ``loss + aux``: the auxiliary loss gets the microbatch's weight like the main loss, and its
share no longer depends on the number of microbatches per rank or on the data-parallel size.
"""

from __future__ import annotations

from typing import Any

import torch

from d9d.kernels.layers import pooled_load_balancing_loss

LOAD_BALANCING_KEY = "load_balancing_statistics"
"""Hand-off entry: ``(batch, 2 * experts + 1)`` rows whose sum is the microbatch's routing statistics."""


def add_stage_share(
    rows: torch.Tensor | None, share: torch.Tensor | None, batch: int, width: int
) -> torch.Tensor:
    """The hand-off rows after a stage: the previous rows plus ``share`` spread over ``batch`` rows.

    Args:
        rows: The previous stage's rows, or None on the first stage.
        share: This stage's summed statistics ``(width,)``, or None (no sparse layer, or eval).
        batch: Rows of the microbatch.
        width: ``2 * experts + 1``.
    """
    if rows is None:
        device = share.device if share is not None else None
        rows = torch.zeros(batch, width, dtype=torch.float32, device=device)
    if share is None:
        return rows
    return rows + (share.to(torch.float32) / batch).expand(batch, width)


def pooled_loss_of_rows(rows: torch.Tensor, coefficient: float) -> torch.Tensor:
    """``coefficient`` times the load-balancing loss pooled over every layer the rows carry."""
    return coefficient * pooled_load_balancing_loss(rows.sum(dim=0))


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
