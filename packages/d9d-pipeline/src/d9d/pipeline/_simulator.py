"""Simulates a program's timeline from per-action costs: bubble fraction and live activations."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.pipeline._actions import Action, ActionKind
from d9d.pipeline._drawing import draw_timeline_text
from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._timed_action import TimedAction


@dataclass(frozen=True, kw_only=True)
class ActionCosts:
    """Duration of each kind of compute action, in any time unit.

    Attributes:
        forward: Cost of ``F``.
        backward: Cost of a full ``B``.
        backward_input: Cost of ``I``; defaults to half of ``backward``.
        backward_weight: Cost of ``W``; defaults to half of ``backward``.
        communication: Latency between a send and the receive it feeds.
        overlapped_pair: Duration of an overlapped pair (a forward in ``program.overlapped`` and
            the backward after it, run interleaved); defaults to the sum of the two, i.e. no gain.
            DualPipe's ``F&B``: less than the sum when one's communication hides behind the
            other's compute.
    """

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float | None = None
    backward_weight: float | None = None
    communication: float = 0.0
    overlapped_pair: float | None = None

    def of(self, kind: ActionKind) -> float:
        """The cost of a compute action of ``kind``."""
        match kind:
            case ActionKind.FORWARD:
                return self.forward
            case ActionKind.BACKWARD:
                return self.backward
            case ActionKind.BACKWARD_INPUT:
                return self.backward / 2 if self.backward_input is None else self.backward_input
            case ActionKind.BACKWARD_WEIGHT:
                return self.backward / 2 if self.backward_weight is None else self.backward_weight
            case _:
                return 0.0


@dataclass(frozen=True, kw_only=True)
class SimulationResult:
    """The simulated timeline of a program.

    Attributes:
        program: The simulated program.
        timeline: For every rank, its compute actions with start and end times.
        makespan: Time at which the last action ends.
        bubble_fraction: Idle share of all ranks' time up to the makespan.
        rank_bubble_fractions: Idle share of each rank's time up to the makespan.
        peak_live_activations: For every rank, the most (stage, microbatch) activations it held at
            once: counted from a forward's start until the backward that frees them ends (``B``, or
            ``W`` of a split backward; the forward's own end in a forward-only program).
    """

    program: PipelineProgram
    timeline: tuple[tuple[TimedAction, ...], ...]
    makespan: float
    bubble_fraction: float
    rank_bubble_fractions: tuple[float, ...]
    peak_live_activations: tuple[int, ...]

    def draw_text(self, *, width: int | None = None) -> str:
        """The timeline as text; see :func:`draw_timeline_text`."""
        return draw_timeline_text(self, width=width)


def simulate_program(program: PipelineProgram, costs: ActionCosts | None = None) -> SimulationResult:
    """Runs ``program`` on a model of time: each rank executes its actions in order, a compute
    action starts when its rank is free and its inputs have arrived, a receive blocks its rank until
    the matching send was posted plus the communication latency. An overlapped pair starts when
    both halves' inputs are there and lasts ``costs.overlapped_pair``; its forward is drawn over the
    first part of that span, its backward over the rest, in proportion to their own costs.

    Args:
        program: The program (validate it first: a deadlocking program raises here).
        costs: Per-action costs; defaults ``F = 1``, ``B = 2`` (``I = W = 1``).

    Returns:
        The timeline and its statistics.

    Raises:
        ValueError: If the program cannot finish (a deadlock).
    """
    costs = costs or ActionCosts()
    n = program.num_ranks
    clock = [0.0] * n
    pointer = [0] * n
    sent_at: dict[tuple[int, Action], float] = {}
    finished: dict[tuple[ActionKind, int, int], float] = {}
    timeline: list[list[TimedAction]] = [[] for _ in range(n)]
    remaining = sum(len(a) for a in program.actions)
    while remaining:
        progressed = False
        for rank, acts in enumerate(program.actions):
            while pointer[rank] < len(acts):
                action = acts[pointer[rank]]
                if action.kind.is_recv:
                    key = (rank, action)
                    if key not in sent_at:
                        break
                    clock[rank] = max(clock[rank], sent_at[key] + costs.communication)
                elif action.kind.is_send:
                    sent_at[(action.peer_rank, action.matching(own_rank=rank))] = clock[rank]
                else:
                    group = list(acts[pointer[rank] : pointer[rank] + 2])
                    if action not in program.overlapped:
                        group = group[:1]
                    deps = [_local_dependency(program, a) for a in group]
                    if any(d is not None and d not in finished for d in deps):
                        break
                    start = max([clock[rank], *(finished[d] for d in deps if d is not None)])
                    own = [costs.of(a.kind) for a in group]
                    total = sum(own)
                    span = (
                        total if len(group) == 1 or costs.overlapped_pair is None else costs.overlapped_pair
                    )
                    for a, cost in zip(group, own, strict=True):
                        end = start + (cost * span / total if total > 0 else 0.0)
                        timeline[rank].append(TimedAction(action=a, rank=rank, start=start, end=end))
                        finished[(a.kind, a.stage, a.microbatch)] = end
                        start = end
                    clock[rank] = start
                    pointer[rank] += len(group) - 1
                    remaining -= len(group) - 1
                pointer[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [
                f"rank {r}: {program.actions[r][pointer[r]]}"
                for r in range(n)
                if pointer[r] < len(program.actions[r])
            ]
            raise ValueError("program deadlocks; blocked at " + ", ".join(stuck))
    makespan = max(clock, default=0.0)
    busy = [sum(t.end - t.start for t in row) for row in timeline]
    rank_bubbles = tuple(1.0 - b / makespan if makespan > 0 else 0.0 for b in busy)
    bubble = 1.0 - sum(busy) / (n * makespan) if makespan > 0 else 0.0
    return SimulationResult(
        program=program,
        timeline=tuple(tuple(row) for row in timeline),
        makespan=makespan,
        bubble_fraction=bubble,
        rank_bubble_fractions=rank_bubbles,
        peak_live_activations=tuple(_peak_live(row, program.training) for row in timeline),
    )


def _local_dependency(program: PipelineProgram, action: Action) -> tuple[ActionKind, int, int] | None:
    """The same-rank compute a compute action must wait for (its data on the same rank)."""
    s, m, where = action.stage, action.microbatch, program.stage_to_rank
    if action.kind == ActionKind.BACKWARD_WEIGHT:
        return (ActionKind.BACKWARD_INPUT, s, m)
    if action.kind == ActionKind.FORWARD and s > 0 and where[s - 1] == where[s]:
        return (ActionKind.FORWARD, s - 1, m)
    if action.kind.is_backward and s + 1 < program.num_stages and where[s + 1] == where[s]:
        return (
            (ActionKind.BACKWARD_INPUT, s + 1, m)
            if _is_split(program, s + 1, m)
            else (ActionKind.BACKWARD, s + 1, m)
        )
    return None


def _is_split(program: PipelineProgram, stage: int, microbatch: int) -> bool:
    rank = program.stage_to_rank[stage]
    return any(
        a.kind == ActionKind.BACKWARD_INPUT and a.stage == stage and a.microbatch == microbatch
        for a in program.actions[rank]
    )


def _peak_live(row: tuple[TimedAction, ...] | list[TimedAction], training: bool) -> int:
    events: list[tuple[float, int]] = []
    for t in row:
        kind = t.action.kind
        if kind == ActionKind.FORWARD:
            events.append((t.start, 1))
            if not training:
                events.append((t.end, -1))
        elif kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            events.append((t.end, -1))
    live = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        live += delta
        peak = max(peak, live)
    return peak
