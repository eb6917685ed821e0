"""The instructions of a pipeline program: compute actions and point-to-point communication.

Vocabulary: a *stage* is a contiguous slice of the model (stage 0 takes the batch, the last stage
produces what the loss callback reads); a *microbatch* is one of the equal pieces the batch is
split into along tensor dim 0; a *rank* is a member of the pipeline process group and holds one
or more stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ActionKind(StrEnum):
    """What an action does. The value is the short code used when a program is printed."""

    FORWARD = "F"
    """Runs a stage's forward on a microbatch (and the loss callback on the last stage)."""
    BACKWARD = "B"
    """Full backward of a stage on a microbatch: input and weight gradients together."""
    BACKWARD_INPUT = "I"
    """First half of a split backward: gradients of the stage inputs only."""
    BACKWARD_WEIGHT = "W"
    """Second half of a split backward: gradients of the stage parameters."""
    SEND_ACTIVATION = "SA"
    """Sends a stage's forward outputs to the rank of the next stage."""
    RECV_ACTIVATION = "RA"
    """Receives a stage's forward inputs from the rank of the previous stage."""
    SEND_GRAD = "SG"
    """Sends the gradients of a stage's inputs to the rank of the previous stage."""
    RECV_GRAD = "RG"
    """Receives the gradients of a stage's outputs from the rank of the next stage."""

    @property
    def is_compute(self) -> bool:
        """Whether the action runs model code (as opposed to communication)."""
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        """Whether the action posts a send."""
        return self in (ActionKind.SEND_ACTIVATION, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        """Whether the action posts a receive."""
        return self in (ActionKind.RECV_ACTIVATION, ActionKind.RECV_GRAD)

    @property
    def is_backward(self) -> bool:
        """Whether the action is a (full or input) backward that produces input gradients."""
        return self in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)


_COMPUTE = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
)


@dataclass(frozen=True, kw_only=True)
class Action:
    """One instruction of a rank's program.

    Attributes:
        kind: What the action does.
        stage: The stage the action belongs to. For sends it is the stage whose data is sent (its
            outputs for ``SEND_ACTIVATION``, its input gradients for ``SEND_GRAD``); for receives the
            stage that consumes the data (its inputs for ``RECV_ACTIVATION``, its output gradients
            for ``RECV_GRAD``).
        microbatch: Index of the microbatch.
        peer: For communication, the pipeline-group rank at the other end; None for compute.
    """

    kind: ActionKind
    stage: int
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.stage}.{self.microbatch}"
        if self.peer is not None:
            arrow = "->" if self.kind.is_send else "<-"
            text += f"{arrow}r{self.peer}"
        return text

    @property
    def peer_rank(self) -> int:
        """The peer of a communication action.

        Raises:
            ValueError: If the action has no peer (compute, or a malformed communication action).
        """
        if self.peer is None:
            raise ValueError(f"action {self} has no peer rank")
        return self.peer

    def matching(self, *, own_rank: int) -> Action:
        """The action on the peer rank that completes this send or receive.

        Raises:
            ValueError: If the action is not communication.
        """
        match self.kind:
            case ActionKind.SEND_ACTIVATION:
                return Action(
                    kind=ActionKind.RECV_ACTIVATION,
                    stage=self.stage + 1,
                    microbatch=self.microbatch,
                    peer=own_rank,
                )
            case ActionKind.RECV_ACTIVATION:
                return Action(
                    kind=ActionKind.SEND_ACTIVATION,
                    stage=self.stage - 1,
                    microbatch=self.microbatch,
                    peer=own_rank,
                )
            case ActionKind.SEND_GRAD:
                return Action(
                    kind=ActionKind.RECV_GRAD, stage=self.stage - 1, microbatch=self.microbatch, peer=own_rank
                )
            case ActionKind.RECV_GRAD:
                return Action(
                    kind=ActionKind.SEND_GRAD, stage=self.stage + 1, microbatch=self.microbatch, peer=own_rank
                )
            case _:
                raise ValueError(f"action {self} is not communication and has no matching action")


def forward(stage: int, microbatch: int) -> Action:
    """A forward compute action."""
    return Action(kind=ActionKind.FORWARD, stage=stage, microbatch=microbatch)


def backward(stage: int, microbatch: int) -> Action:
    """A full backward compute action."""
    return Action(kind=ActionKind.BACKWARD, stage=stage, microbatch=microbatch)


def backward_input(stage: int, microbatch: int) -> Action:
    """An input-gradient backward compute action (first half of a split backward)."""
    return Action(kind=ActionKind.BACKWARD_INPUT, stage=stage, microbatch=microbatch)


def backward_weight(stage: int, microbatch: int) -> Action:
    """A weight-gradient backward compute action (second half of a split backward)."""
    return Action(kind=ActionKind.BACKWARD_WEIGHT, stage=stage, microbatch=microbatch)
