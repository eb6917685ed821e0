"""GPipe, 1F1B and forward-only: one stage per rank."""

from __future__ import annotations

from d9d.pipeline._actions import Action, backward, forward
from d9d.pipeline._communication import make_program
from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._schedules._checks import check_counts


def build_gpipe_program(*, num_ranks: int, num_microbatches: int) -> PipelineProgram:
    """GPipe: every rank runs all forwards, then all backwards.

    Stage ``r`` on rank ``r``. Bubble fraction ``(p - 1) / (m + p - 1)``; every rank keeps the
    activations of all ``m`` microbatches alive at its peak.
    """
    check_counts("gpipe", num_ranks=num_ranks, num_microbatches=num_microbatches)
    compute: list[list[Action]] = []
    for rank in range(num_ranks):
        acts = [forward(rank, m) for m in range(num_microbatches)]
        acts += [backward(rank, m) for m in range(num_microbatches)]
        compute.append(acts)
    return make_program(num_microbatches=num_microbatches, stage_to_rank=range(num_ranks), compute=compute)


def build_1f1b_program(*, num_ranks: int, num_microbatches: int) -> PipelineProgram:
    """1F1B: warm up with ``p - r - 1`` forwards, then alternate one forward and one backward.

    Stage ``r`` on rank ``r``. Same bubble as GPipe, ``(p - 1) / (m + p - 1)``, but rank ``r``
    keeps at most ``p - r`` microbatches' activations alive.
    """
    check_counts("1f1b", num_ranks=num_ranks, num_microbatches=num_microbatches)
    compute: list[list[Action]] = []
    for rank in range(num_ranks):
        warmup = min(num_ranks - rank - 1, num_microbatches)
        acts = [forward(rank, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            acts += [forward(rank, warmup + i), backward(rank, i)]
        acts += [backward(rank, m) for m in range(num_microbatches - warmup, num_microbatches)]
        compute.append(acts)
    return make_program(num_microbatches=num_microbatches, stage_to_rank=range(num_ranks), compute=compute)


def build_forward_only_program(*, num_ranks: int, num_microbatches: int) -> PipelineProgram:
    """Inference: stage ``r`` on rank ``r`` runs the forward of every microbatch in order."""
    check_counts("forward_only", num_ranks=num_ranks, num_microbatches=num_microbatches)
    compute = [[forward(rank, m) for m in range(num_microbatches)] for rank in range(num_ranks)]
    return make_program(
        num_microbatches=num_microbatches, stage_to_rank=range(num_ranks), compute=compute, training=False
    )
