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
import torch.distributed as dist
from torch.distributed import ProcessGroup

from d9d.kernels.layers import pooled_load_balancing_loss
from d9d.mesh import BATCH_DOMAIN, DistributedContext

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


def load_balancing_groups(dist_context: DistributedContext) -> tuple[ProcessGroup, ...]:
    """The groups over which a stage sums its load-balancing statistics: data and context parallel.

    Those ranks hold the other rows (and sequence chunks) of the same microbatch step; expert
    parallelism splits the data-parallel ranks, so it is covered; pipeline stages hand the
    statistics on with the activations and tensor-parallel ranks hold the same tokens.
    """
    batch = dist_context.mesh_for(BATCH_DOMAIN)
    return tuple(batch[dim].get_group() for dim in ("dp", "cp") if batch[dim].size() > 1)


class _SumAcrossRanks(torch.autograd.Function):
    """All-reduce (sum) in forward and in backward: every rank's statistics get the gradient of
    the loss of the sum through every rank's weight of it."""

    @staticmethod
    def forward(ctx: Any, statistics: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = statistics.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad_outputs[0].contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def pooled_loss_of_rows(
    rows: torch.Tensor, coefficient: float, groups: tuple[ProcessGroup, ...] = ()
) -> torch.Tensor:
    """``coefficient`` times the load-balancing loss pooled over every layer the rows carry.

    Args:
        rows: The last stage's hand-off rows ``(batch, 2 * experts + 1)``.
        coefficient: ``router_aux_loss_coef``.
        groups: The process groups whose ranks hold the other parts of the same microbatch step
            (data- and context-parallel ranks): the statistics are summed over them, so the
            loss is the one of the global microbatch, as one process computes it on that batch.
    """
    statistics = rows.sum(dim=0)
    for group in groups:
        total = _SumAcrossRanks.apply(statistics, group)
        if not isinstance(total, torch.Tensor):
            raise TypeError("the all-reduce of the load-balancing statistics returned no tensor")
        statistics = total
    return coefficient * pooled_load_balancing_loss(statistics)


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
