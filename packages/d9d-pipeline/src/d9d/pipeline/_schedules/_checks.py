"""Argument checks shared by the schedule builders."""

from __future__ import annotations


def check_counts(schedule: str, *, num_ranks: int, num_microbatches: int, min_microbatches: int = 1) -> None:
    """Raises ValueError naming the schedule if a count is unusable."""
    if num_ranks < 1:
        raise ValueError(f"{schedule}: num_ranks must be >= 1, got {num_ranks}")
    if num_microbatches < min_microbatches:
        raise ValueError(
            f"{schedule}: num_microbatches={num_microbatches} is too few; "
            f"this schedule needs at least {min_microbatches} on {num_ranks} ranks"
        )


def loop_placement(num_ranks: int, stages_per_rank: int) -> list[int]:
    """Stage ``s`` on rank ``s % num_ranks``: each rank holds every ``num_ranks``-th stage."""
    return [s % num_ranks for s in range(num_ranks * stages_per_rank)]


def v_placement(num_ranks: int) -> list[int]:
    """Two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2 * num_ranks - 1 - r``.

    The last rank holds the two middle stages and rank 0 holds the first and the last stage, so
    the loss is computed where the batch enters.
    """
    return [s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks)]
