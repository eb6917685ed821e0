"""Cross-entropy over logits whose vocabulary is sharded across tensor-parallel ranks."""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from d9d.parallel._mesh_dims import require_one_dim


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        start: int,
        ignore_index: int,
        group: ProcessGroup,
    ) -> torch.Tensor:
        logits = logits.float()
        maximum = logits.max(dim=-1).values
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - maximum.unsqueeze(-1)).exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        local_labels = labels - start
        valid = labels != ignore_index
        here = valid & (local_labels >= 0) & (local_labels < logits.shape[-1])
        index = torch.where(here, local_labels, 0)
        target = torch.where(here, logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - maximum, 0.0)
        dist.all_reduce(target, group=group)
        loss = torch.where(valid, total.log() - target, 0.0)
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, here, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, index, here, valid = cast(tuple[torch.Tensor, ...], ctx.saved_tensors)
        grad = grad_outputs[0] * valid
        grad_logits = softmax * grad.unsqueeze(-1)
        grad_logits.scatter_add_(-1, index.unsqueeze(-1), (-grad * here).unsqueeze(-1))
        return grad_logits, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    mesh: DeviceMesh,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> torch.Tensor:
    """Cross-entropy of logits sharded over the vocabulary (the last tensor dim) on a tp mesh.

    Rank ``r`` holds vocabulary entries ``[r * V_local, (r + 1) * V_local)`` (as ``Shard(-1)`` or
    a colwise-parallel head lays them out). Maxima, normalizers and target logits are
    all-reduced, so no rank gathers the full logits; the result equals ``F.cross_entropy`` on the
    gathered logits and is the same on every tp rank. The gradient flows to the local logits.

    Args:
        logits: This rank's logits, (..., V_local), any float dtype (computed in float32).
        labels: Global token ids, the shape of ``logits`` without its last dim; the same on all
            tp ranks.
        mesh: The 1-D tensor-parallel mesh.
        ignore_index: Label whose tokens get loss 0 and are left out of the mean.
        reduction: ``"mean"`` over non-ignored tokens, ``"sum"``, or ``"none"`` (per token).

    Returns:
        The loss (float32).
    """
    require_one_dim(mesh, purpose="vocab_parallel_cross_entropy")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and labels "
            f"{tuple(labels.shape)} differ outside the vocabulary dim"
        )
    start = mesh.get_local_rank() * logits.shape[-1]
    loss = cast(
        torch.Tensor,
        _VocabParallelCrossEntropy.apply(logits, labels, start, ignore_index, mesh.get_group()),
    )
    match reduction:
        case "none":
            return loss
        case "sum":
            return loss.sum()
        case "mean":
            return loss.sum() / (labels != ignore_index).sum().clamp(min=1)
