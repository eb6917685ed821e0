"""A pipeline program: the stage placement and, for every rank, its list of actions."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.pipeline._actions import Action, ActionKind
from d9d.pipeline._stage_info import PipelineStageInfo


@dataclass(frozen=True, kw_only=True)
class PipelineProgram:
    """What every rank of a pipeline does in one step, in order.

    A program is plain data: print it, check it with :func:`validate_program`, simulate it with
    :func:`simulate_program`, or run it with an executor. Schedule builders produce programs; a new
    schedule is a new function that returns one.

    Attributes:
        num_microbatches: Number of microbatches one step runs.
        stage_to_rank: For every stage, the pipeline-group rank that holds it.
        actions: For every rank, its actions in execution order.
        training: Whether the program runs backward (False for forward-only programs).
        overlapped: Forward actions that run interleaved with the compute action right after them
            on their rank (a backward of another stage), DualPipeV's overlapped pairs: the receives
            of both come before the forward, the sends of both after the backward, and an executor
            alternates between the two at the stages' overlap points (see :class:`OverlapPoints`).
    """

    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    training: bool = True
    overlapped: frozenset[Action] = frozenset()

    @property
    def num_stages(self) -> int:
        """Total number of stages."""
        return len(self.stage_to_rank)

    @property
    def num_ranks(self) -> int:
        """Number of ranks of the pipeline group."""
        return len(self.actions)

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def stage_infos(self, rank: int) -> list[PipelineStageInfo]:
        """The :class:`PipelineStageInfo` of every stage ``rank`` holds, in increasing stage order."""
        return [PipelineStageInfo(s, self.num_stages) for s in self.stages_of(rank)]

    def compute_actions(self, rank: int) -> list[Action]:
        """``rank``'s compute actions, in order (communication left out)."""
        return [a for a in self.actions[rank] if a.kind.is_compute]

    def __str__(self) -> str:
        return self.format(show_communication=True)

    def format(self, *, show_communication: bool = False) -> str:
        """One line per rank listing its actions, e.g. ``rank 0: F0.0 F0.1 B0.0 B0.1``.

        An overlapped forward is printed with a ``+`` (``F0.2+ B1.0``: the two run interleaved).

        Args:
            show_communication: Whether sends and receives are listed too.
        """
        lines = [
            f"program: {self.num_stages} stages on {self.num_ranks} ranks, "
            f"{self.num_microbatches} microbatches, stage->rank {list(self.stage_to_rank)}"
        ]
        for rank, acts in enumerate(self.actions):
            shown = [
                f"{a}+" if a in self.overlapped else str(a)
                for a in acts
                if show_communication or a.kind.is_compute
            ]
            lines.append(f"rank {rank}: " + " ".join(shown))
        return "\n".join(lines)


def is_backward_kind(kind: ActionKind) -> bool:
    """Whether ``kind`` is a backward compute kind (full, input or weight)."""
    return kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
