"""DualPipeV: DeepSeek's V-shaped schedule with split backward in its ramp-up and ramp-down.

Rank ``r`` of ``p`` holds chunk 0 = stage ``r`` (down the V) and chunk 1 = stage ``2p - 1 - r`` (back
up). The order follows DualPipeV's eight phases. Where DualPipeV overlaps a forward of one chunk
with a backward of the other (the steady phase and the ramp-down's ``B1 F1 B0`` rounds), the
program marks the pair as overlapped (``PipelineProgram.overlapped``), and the executor runs the
two interleaved.
"""

from __future__ import annotations

from collections import deque

from d9d.pipeline._actions import Action, backward, backward_input, backward_weight, forward
from d9d.pipeline._communication import make_program
from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._schedules._checks import check_counts, v_placement


class _RankBuilder:
    def __init__(self, *, rank: int, num_ranks: int) -> None:
        self.stage = (rank, 2 * num_ranks - 1 - rank)
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.weights: deque[tuple[int, int]] = deque()
        self.actions: list[Action] = []
        self.overlapped: set[Action] = set()

    def f(self, chunk: int, *, overlap: bool = False) -> None:
        action = forward(self.stage[chunk], self.next_f[chunk])
        self.actions.append(action)
        if overlap:
            self.overlapped.add(action)
        self.next_f[chunk] += 1

    def b(self, chunk: int, *, split: bool = False) -> None:
        s, m = self.stage[chunk], self.next_b[chunk]
        self.next_b[chunk] += 1
        if split:
            self.actions.append(backward_input(s, m))
            self.weights.append((s, m))
        else:
            self.actions.append(backward(s, m))

    def w(self) -> None:
        self.actions.append(backward_weight(*self.weights.popleft()))


def build_dualpipev_program(
    *, num_ranks: int, num_microbatches: int, overlap: bool = False
) -> PipelineProgram:
    """DualPipeV on ``p`` ranks (``2p`` stages); needs ``num_microbatches >= 2p``.

    Phases on rank ``r``: ``2(p - r - 1)`` chunk-0 forwards; ``r + 1`` pairs of chunk-0 and chunk-1
    forwards; ``p - r - 1`` rounds of chunk-1 input backward, weight backward, chunk-1 forward; the
    steady phase (``m - 2p + r + 1`` rounds of F0 B1 F1 B0); ``p - r - 1`` rounds of B1 F1 B0;
    ``r + 1`` rounds of B1 B0 switching to split backward half-way; ``p - r - 1`` rounds of a
    weight backward and a split chunk-0 backward; the remaining ``r + 1`` weight backwards.

    Args:
        num_ranks: Pipeline ranks ``p``.
        num_microbatches: Microbatches per step, at least ``2p``.
        overlap: Mark each forward that DualPipeV overlaps with the backward after it (F0 with
            B1 and F1 with B0) as overlapped; False (the default) runs them one after the other.

    Raises:
        ValueError: If ``num_microbatches < 2 * num_ranks``.
    """
    p, m_total = num_ranks, num_microbatches
    check_counts("dualpipev", num_ranks=p, num_microbatches=m_total, min_microbatches=2 * p)
    compute: list[list[Action]] = []
    overlapped: set[Action] = set()
    for r in range(p):
        rb = _RankBuilder(rank=r, num_ranks=p)
        for _ in range(2 * (p - r - 1)):
            rb.f(0)
        for _ in range(r + 1):
            rb.f(0)
            rb.f(1)
        for _ in range(p - r - 1):
            rb.b(1, split=True)
            rb.w()
            rb.f(1)
        for _ in range(m_total - 2 * p + r + 1):
            rb.f(0, overlap=overlap)
            rb.b(1)
            rb.f(1, overlap=overlap)
            rb.b(0)
        for _ in range(p - r - 1):
            rb.b(1)
            rb.f(1, overlap=overlap)
            rb.b(0)
        split = False
        steps = r + 1
        for i in range(steps):
            if i == steps // 2 and r % 2 == 1:
                split = True
            rb.b(1, split=split)
            if i == steps // 2 and r % 2 == 0:
                split = True
            rb.b(0, split=split)
        for _ in range(p - r - 1):
            rb.w()
            rb.b(0, split=True)
        while rb.weights:
            rb.w()
        compute.append(rb.actions)
        overlapped |= rb.overlapped
    return make_program(
        num_microbatches=m_total,
        stage_to_rank=v_placement(p),
        compute=compute,
        overlapped=frozenset(overlapped),
    )
