"""Several stages per rank on a loop placement: interleaved 1F1B and looped BFS."""

from __future__ import annotations

from d9d.pipeline._actions import Action, backward, forward
from d9d.pipeline._communication import make_program
from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._schedules._checks import check_counts, loop_placement


def _check_stages_per_rank(schedule: str, stages_per_rank: int) -> None:
    if stages_per_rank < 1:
        raise ValueError(f"{schedule}: stages_per_rank must be >= 1, got {stages_per_rank}")


def build_interleaved_1f1b_program(
    *, num_ranks: int, num_microbatches: int, stages_per_rank: int
) -> PipelineProgram:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline).

    Rank ``r`` holds stages ``r, r + p, r + 2p, ...`` (``v = stages_per_rank`` of them). Microbatches
    go through the rank's stages in groups of ``p``: forwards of chunk 0 for ``p`` microbatches,
    then chunk 1 for the same ones, and so on; backwards mirror this from the last chunk. After a
    warm-up of ``2 (p - r - 1) + (v - 1) p`` forwards, forwards and backwards alternate. Bubble
    fraction ``(p - 1) / (v m + p - 1)``.

    Raises:
        ValueError: If ``num_microbatches`` is not a multiple of ``num_ranks``.
    """
    name = "interleaved_1f1b"
    _check_stages_per_rank(name, stages_per_rank)
    check_counts(name, num_ranks=num_ranks, num_microbatches=num_microbatches, min_microbatches=num_ranks)
    p, v, m_total = num_ranks, stages_per_rank, num_microbatches
    if m_total % p != 0:
        raise ValueError(
            f"{name}: num_microbatches={m_total} must be a multiple of num_ranks={p} "
            "(microbatches go through each rank's stages in groups of num_ranks)"
        )

    def unit(rank: int, k: int, *, reverse: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        if reverse:
            chunk = v - 1 - chunk
        return chunk * p + rank, group * p + within % p

    total = m_total * v
    compute: list[list[Action]] = []
    for rank in range(p):
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
        acts = [forward(*unit(rank, k, reverse=False)) for k in range(warmup)]
        for k in range(total - warmup):
            acts.append(forward(*unit(rank, warmup + k, reverse=False)))
            acts.append(backward(*unit(rank, k, reverse=True)))
        acts += [backward(*unit(rank, k, reverse=True)) for k in range(total - warmup, total)]
        compute.append(acts)
    return make_program(num_microbatches=m_total, stage_to_rank=loop_placement(p, v), compute=compute)


def build_looped_bfs_program(
    *, num_ranks: int, num_microbatches: int, stages_per_rank: int
) -> PipelineProgram:
    """Looped BFS (breadth-first): each rank runs all microbatches through one of its stages at a time.

    Rank ``r`` holds stages ``r, r + p, ...``; it runs the forwards of every microbatch on its first
    stage, then on its next, and the backwards from its last stage back. Good with data-parallel
    sharding that gathers a stage's weights once; every rank keeps all microbatches' activations.
    """
    name = "looped_bfs"
    _check_stages_per_rank(name, stages_per_rank)
    check_counts(name, num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, v, m_total = num_ranks, stages_per_rank, num_microbatches
    compute: list[list[Action]] = []
    for rank in range(p):
        stages = [c * p + rank for c in range(v)]
        acts = [forward(s, m) for s in stages for m in range(m_total)]
        acts += [backward(s, m) for s in reversed(stages) for m in range(m_total)]
        compute.append(acts)
    return make_program(num_microbatches=m_total, stage_to_rank=loop_placement(p, v), compute=compute)
