"""Keeping the two copies of a tied embedding equal when pipeline stages hold one each.

With ``tie_word_embeddings`` and pipeline parallelism, the first stage holds
``model.embed_tokens.weight`` and the last stage ``lm_head.weight``, two parameters that must stay
one (as Megatron does): both start equal (loaded from the same checkpoint tensor, or copied with
``broadcast_tied_weight``) and receive the same update because their gradients are summed
between the two stages before every optimizer step (``sum_tied_gradients``). The group holds,
for each position in the other mesh dims, the rank of the first and the rank of the last stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sum_tied_gradients(weight: torch.Tensor, group: ProcessGroup) -> None:
    """All-reduces (sums) ``weight.grad`` over ``group``, in place.

    Both stages must shard their copy identically (the same FSDP/TP layout), since the local
    shards are summed. A missing gradient counts as zero.

    Args:
        weight: This rank's copy: the embedding weight on the first stage, the LM head weight on
            the last.
        group: The first-stage and last-stage ranks that hold the same shard.
    """
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad
    dist.all_reduce(_local(grad), op=dist.ReduceOp.SUM, group=group)


@torch.no_grad()
def broadcast_tied_weight(weight: torch.Tensor, group: ProcessGroup, *, source_rank: int) -> None:
    """Copies the first stage's values into the last stage's copy (after a fresh initialization).

    Args:
        weight: This rank's copy.
        group: As for ``sum_tied_gradients``.
        source_rank: Global rank of the first-stage member of ``group``.
    """
    dist.broadcast(_local(weight), src=source_rank, group=group)
