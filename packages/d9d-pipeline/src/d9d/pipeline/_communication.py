"""Inserts the sends and receives a program's compute actions need, from the stage placement.

Rules, for a stage ``s`` held by rank ``r``:

- after ``F s.m``, if stage ``s+1`` lives on another rank: send the activation there;
- before ``F s.m``, if stage ``s-1`` lives on another rank: receive the activation from there;
- after ``B``/``I s.m``, if stage ``s-1`` lives on another rank: send the input gradients there;
- before ``B``/``I s.m``, if stage ``s+1`` lives on another rank: receive the output gradients.

Neighbouring stages on the same rank hand data over locally, without communication. An
overlapped pair (a forward in ``program.overlapped`` and the compute action after it) takes its
receives before the forward and its sends after the backward, since the two run interleaved.

Point-to-point messages between two ranks are matched in the order they are posted (NCCL and gloo
both work this way), so the receives from one sender must be posted in the order that sender
posts its sends. When a rank needs a message that its sender sends after others it has not
received yet, those earlier messages are received first, at the same place. Sends never block the
program (they are asynchronous and waited at the end of the step); receives are waited before the
compute action that reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

from d9d.pipeline._actions import Action, ActionKind
from d9d.pipeline._program import PipelineProgram


def _sends_after(action: Action, program: PipelineProgram, rank: int) -> list[Action]:
    s, m = action.stage, action.microbatch
    where = program.stage_to_rank
    if action.kind == ActionKind.FORWARD and s + 1 < program.num_stages and where[s + 1] != rank:
        return [Action(kind=ActionKind.SEND_ACTIVATION, stage=s, microbatch=m, peer=where[s + 1])]
    if action.kind.is_backward and s > 0 and where[s - 1] != rank:
        return [Action(kind=ActionKind.SEND_GRAD, stage=s, microbatch=m, peer=where[s - 1])]
    return []


def receive_needed(action: Action, program: PipelineProgram, rank: int) -> Action | None:
    """The receive a compute action of ``rank`` reads its data from, or None when the data is local."""
    s, m = action.stage, action.microbatch
    where = program.stage_to_rank
    if action.kind == ActionKind.FORWARD and s > 0 and where[s - 1] != rank:
        return Action(kind=ActionKind.RECV_ACTIVATION, stage=s, microbatch=m, peer=where[s - 1])
    if action.kind.is_backward and s + 1 < program.num_stages and where[s + 1] != rank:
        return Action(kind=ActionKind.RECV_GRAD, stage=s, microbatch=m, peer=where[s + 1])
    return None


def insert_communication(program: PipelineProgram) -> PipelineProgram:
    """Returns ``program`` with its communication actions replaced by those its compute needs.

    Existing communication actions are dropped and inserted anew, so the function is idempotent.
    """
    compute = [program.compute_actions(rank) for rank in range(program.num_ranks)]
    # For every (sender, receiver) pair, the receives matching the sender's sends, in send order.
    send_order: dict[tuple[int, int], list[Action]] = {}
    for rank, acts in enumerate(compute):
        for action in acts:
            for send in _sends_after(action, program, rank):
                send_order.setdefault((rank, send.peer_rank), []).append(send.matching(own_rank=rank))
    result: list[tuple[Action, ...]] = []
    for rank, acts in enumerate(compute):
        posted: set[Action] = set()
        next_index: dict[int, int] = {}
        out: list[Action] = []
        for group in _compute_groups(acts, program.overlapped):
            for action in group:
                recv = receive_needed(action, program, rank)
                if recv is None or recv in posted:
                    continue
                order = send_order.get((recv.peer_rank, rank), [])
                if recv in order:
                    stop = order.index(recv)
                    start = next_index.get(recv.peer_rank, 0)
                    for earlier in order[start : stop + 1]:
                        if earlier not in posted:
                            out.append(earlier)
                            posted.add(earlier)
                    next_index[recv.peer_rank] = max(start, stop + 1)
                else:  # the sender never sends it: leave it for the validator to report
                    out.append(recv)
                    posted.add(recv)
            out.extend(group)
            for action in group:
                out.extend(_sends_after(action, program, rank))
        result.append(tuple(out))
    return PipelineProgram(
        num_microbatches=program.num_microbatches,
        stage_to_rank=program.stage_to_rank,
        actions=tuple(result),
        training=program.training,
        overlapped=program.overlapped,
    )


def _compute_groups(acts: Sequence[Action], overlapped: frozenset[Action]) -> list[list[Action]]:
    """Compute actions one by one, an overlapped forward together with the action after it."""
    groups: list[list[Action]] = []
    i = 0
    while i < len(acts):
        take = 2 if acts[i] in overlapped and i + 1 < len(acts) else 1
        groups.append(list(acts[i : i + take]))
        i += take
    return groups


def make_program(
    *,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    compute: Sequence[Sequence[Action]],
    training: bool = True,
    overlapped: frozenset[Action] = frozenset(),
) -> PipelineProgram:
    """Builds a program from compute actions alone, inserting the communication they need.

    Args:
        num_microbatches: Number of microbatches.
        stage_to_rank: The rank of every stage.
        compute: For every rank, its compute actions in order.
        training: Whether the program runs backward.
        overlapped: Forwards that run interleaved with the compute action after them (see
            :class:`PipelineProgram`).

    Returns:
        The program with sends and receives inserted (see :func:`insert_communication`).
    """
    bare = PipelineProgram(
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(stage_to_rank),
        actions=tuple(tuple(acts) for acts in compute),
        training=training,
        overlapped=overlapped,
    )
    return insert_communication(bare)
