"""A tied embedding split over pipeline stages: gradients summed, values kept equal, every step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from d9d.mesh import DistributedContext, all_gather_object
from d9d.pipeline import PipelineStageInfo


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tied_copies(stages: Sequence[tuple[PipelineStageInfo, nn.Module]]) -> tuple[list[nn.Parameter], bool]:
    """This rank's copies of the tied weight (first stage: the embedding, last: the LM head).

    Returns:
        The copies, and whether one of them is the first stage's (the values' source).
    """
    copies: list[nn.Parameter] = []
    holds_first = False
    for info, model in stages:
        if info.is_first:
            copies.append(model.get_parameter("model.embed_tokens.weight"))
            holds_first = True
        if info.is_last and not info.is_first and isinstance(getattr(model, "lm_head", None), nn.Module):
            copies.append(model.get_parameter("lm_head.weight"))
    return copies, holds_first


class TiedStageCopies:
    """The copies of ``tie_word_embeddings`` held by the first and the last pipeline stage.

    State: the process group of the ranks holding a copy (one per position in the other mesh
    dims), found by asking the pipeline group once the stages are ready (``align``); whether the
    values came from a checkpoint (then equal already). ``align`` gives a freshly initialized
    last-stage copy the first stage's values before the first step.
    """

    def __init__(self) -> None:
        self._ready = False
        self._group: ProcessGroup | None = None
        self._source_rank = 0
        self._loaded = False

    def mark_loaded(self) -> None:
        """Both copies were loaded from the same checkpoint tensor."""
        self._loaded = True

    def _join(self, dist_context: DistributedContext, holds_copy: bool, holds_first: bool) -> None:
        pipeline = dist_context.pipeline_group()
        holders = all_gather_object((dist_context.rank, holds_copy, holds_first), group=pipeline)
        members = sorted(rank for rank, has_copy, _ in holders if has_copy)
        self._source_rank = next(rank for rank, _, first in holders if first)
        if len(members) == dist.get_world_size(pipeline):
            self._group = pipeline
        elif len(members) > 1 and holds_copy:
            group = dist.new_group(members, use_local_synchronization=True)
            if not isinstance(group, ProcessGroup):
                raise RuntimeError(
                    f"rank {dist_context.rank} could not join the tied-embedding group {members}"
                )
            self._group = group
        self._ready = True

    @torch.no_grad()
    def align(
        self, dist_context: DistributedContext, stages: Sequence[tuple[PipelineStageInfo, nn.Module]]
    ) -> list[nn.Parameter]:
        """Joins the copies' group and equalizes their values; collective over the pipeline group.

        Returns:
            This rank's copies other than the first stage's: their gradient duplicates the first
            stage's after ``sum_gradients``, so the gradient norm must leave them out.
        """
        copies, holds_first = tied_copies(stages)
        if not self._ready:
            self._join(dist_context, bool(copies), holds_first)
        if copies and not self._loaded:
            self._align_values(copies)
        return copies[1:] if holds_first else copies

    @torch.no_grad()
    def sum_gradients(
        self, dist_context: DistributedContext, stages: Sequence[tuple[PipelineStageInfo, nn.Module]]
    ) -> None:
        """Sums the copies' gradients (local shards, identically sharded on both stages)."""
        copies, holds_first = tied_copies(stages)
        if not self._ready:  # stages_ready was skipped: values are left as they are
            self._join(dist_context, bool(copies), holds_first)
        if not copies:
            return
        total = torch.zeros_like(_local(copies[0]))
        for copy in copies:
            if copy.grad is not None:
                total += _local(copy.grad)
        if self._group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._group)
        for copy in copies:
            if copy.grad is None:
                copy.grad = torch.zeros_like(copy)
            _local(copy.grad).copy_(total)

    def _align_values(self, copies: list[nn.Parameter]) -> None:
        """Gives every copy the first stage's values (broadcast from the first stage's rank)."""
        value = _local(copies[0]).clone()
        if self._group is not None:
            dist.broadcast(value, src=self._source_rank, group=self._group)
        for copy in copies:
            _local(copy).copy_(value)
