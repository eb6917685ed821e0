"""Zero-bubble schedules with split backward: interleaved zero-bubble (loop placement) and ZBV.

Both are built by one list scheduler that simulates unit-cost actions (``F = I = W = 1``, the
zero-bubble papers' assumption) and, whenever a rank is free, picks by priority:

1. an input backward ``I`` that is ready (it unblocks the previous stage soonest);
2. a ready forward; on the rank's first stage (admitting a new microbatch) only while the rank's
   live activations, plus those its admitted microbatches will create on its later stages, stay
   under its limit (later stages always run: their slots are reserved);
3. a deferred weight backward ``W`` (it fills what would be a bubble; its order is FIFO).

The result is a fixed order per rank; the executor runs it as is under any real costs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from d9d.pipeline._actions import Action, ActionKind, backward_input, backward_weight, forward
from d9d.pipeline._communication import make_program
from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._schedules._checks import check_counts, loop_placement, v_placement


def _list_schedule(
    *, num_microbatches: int, stage_to_rank: Sequence[int], activation_limit: Sequence[int]
) -> list[list[Action]]:
    n_stages, n_mb = len(stage_to_rank), num_microbatches
    n_ranks = max(stage_to_rank) + 1
    local = [[s for s in range(n_stages) if stage_to_rank[s] == r] for r in range(n_ranks)]
    done_at: dict[tuple[ActionKind, int, int], int] = {}
    next_f = [0] * n_stages
    next_i = [0] * n_stages
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(n_ranks)]
    live = [0] * n_ranks
    free_at = [0] * n_ranks
    compute: list[list[Action]] = [[] for _ in range(n_ranks)]
    total = 3 * n_stages * n_mb
    issued, t = 0, 0

    def ready(key: tuple[ActionKind, int, int]) -> bool:
        return key in done_at and done_at[key] <= t

    while issued < total:
        for rank in range(n_ranks):
            if free_at[rank] > t:
                continue
            choice: Action | None = None
            for s in sorted(local[rank], key=lambda s: (next_i[s], -s)):
                m = next_i[s]
                upstream_done = s == n_stages - 1 or ready((ActionKind.BACKWARD_INPUT, s + 1, m))
                if m < n_mb and ready((ActionKind.FORWARD, s, m)) and upstream_done:
                    choice = backward_input(s, m)
                    break
            if choice is None:
                for s in sorted(local[rank], reverse=True):
                    m = next_f[s]
                    if m >= n_mb or not (s == 0 or ready((ActionKind.FORWARD, s - 1, m))):
                        continue
                    # every admitted microbatch will also occupy the rank's later stages: reserve them
                    first, later = local[rank][0], local[rank][1:]
                    reserved = len(later) * next_f[first] - sum(next_f[x] for x in later)
                    if s == local[rank][0] and live[rank] + reserved >= activation_limit[rank]:
                        continue
                    choice = forward(s, m)
                    break
            if choice is None and pending_w[rank]:
                choice = backward_weight(*pending_w[rank].popleft())
            if choice is None:
                continue
            s, m = choice.stage, choice.microbatch
            match choice.kind:
                case ActionKind.FORWARD:
                    next_f[s] += 1
                    live[rank] += 1
                case ActionKind.BACKWARD_INPUT:
                    next_i[s] += 1
                    pending_w[rank].append((s, m))
                case _:
                    live[rank] -= 1
            compute[rank].append(choice)
            done_at[(choice.kind, s, m)] = t + 1
            free_at[rank] = t + 1
            issued += 1
        t += 1
        if t > 10 * total + 10:  # pragma: no cover - the priorities above always make progress
            raise RuntimeError("zero-bubble list scheduler made no progress")
    return compute


def build_interleaved_zero_bubble_program(
    *, num_ranks: int, num_microbatches: int, stages_per_rank: int
) -> PipelineProgram:
    """Interleaved zero-bubble: loop placement (rank ``r`` holds ``r, r + p, ...``) with split backward.

    A rank admits a new microbatch into its first stage only while its live and reserved stage
    activations stay under ``(v + 1) p`` (deferred weight backwards keep a few more alive: the
    simulated peak for ``v = 2`` is 6, 10, 12, 25 on 2, 3, 4, 8 ranks) and fills the remaining
    bubbles with deferred weight backwards; with
    ``F = I = W`` the only idle time left is the pipeline fill, bubble ``(p - 1) / (3 v m + p - 1)``.
    """
    name = "interleaved_zero_bubble"
    if stages_per_rank < 1:
        raise ValueError(f"{name}: stages_per_rank must be >= 1, got {stages_per_rank}")
    check_counts(name, num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, v = num_ranks, stages_per_rank
    limits = [(v + 1) * p] * p
    placement = loop_placement(p, v)
    compute = _list_schedule(
        num_microbatches=num_microbatches, stage_to_rank=placement, activation_limit=limits
    )
    return make_program(num_microbatches=num_microbatches, stage_to_rank=placement, compute=compute)


def build_zbv_program(*, num_ranks: int, num_microbatches: int) -> PipelineProgram:
    """ZBV: two stages per rank in a V (rank ``r`` holds ``r`` and ``2p - 1 - r``) with split backward.

    A rank admits a new microbatch only while its live and reserved stage activations stay under
    ``2p + 2`` (the simulated peak is ``2p + 3`` half-size stage activations, against ``2p`` for
    1F1B's first rank) and fills bubbles with deferred weight backwards; with ``F = I = W`` the
    only idle time left is the pipeline fill, bubble ``(p - 1) / (6 m + p - 1)``.
    """
    check_counts("zbv", num_ranks=num_ranks, num_microbatches=num_microbatches)
    placement = v_placement(num_ranks)
    limits = [2 * num_ranks + 2] * num_ranks
    compute = _list_schedule(
        num_microbatches=num_microbatches, stage_to_rank=placement, activation_limit=limits
    )
    return make_program(num_microbatches=num_microbatches, stage_to_rank=placement, compute=compute)
