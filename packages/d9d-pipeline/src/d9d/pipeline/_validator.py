"""Checks a program before it runs: placement, completeness, matching communication, no deadlock."""

from __future__ import annotations

from collections import Counter

from d9d.pipeline._actions import Action, ActionKind
from d9d.pipeline._communication import receive_needed
from d9d.pipeline._program import PipelineProgram


class PipelineProgramError(ValueError):
    """A program is malformed; the message names every offending rank, action and microbatch."""


def _where(rank: int, action: Action) -> str:
    return f"rank {rank}, action {action} (stage {action.stage}, microbatch {action.microbatch})"


def validate_program(program: PipelineProgram) -> None:
    """Raises if ``program`` cannot run correctly.

    Checked, in order:

    - every stage lives on a rank of the group, every action names a valid stage and microbatch,
      and compute actions run on the rank holding their stage;
    - every microbatch passes every stage forward exactly once and, when training, backward
      exactly once (a full ``B``, or an ``I`` followed by a ``W``);
    - on each rank, a stage's backward follows its forward and ``W`` follows ``I``; sends follow
      the compute that produces their data; an overlapped forward is directly followed by a
      backward (``B`` or ``I``) of another stage;
    - every send has exactly one matching receive on its peer, and between any two ranks the
      receives are posted in the order of the sends;
    - data reaches every compute action (by a receive on its rank, or locally from a neighbouring
      stage), and executing all ranks together, sends asynchronous and receives blocking, finishes:
      the program cannot deadlock.

    Raises:
        PipelineProgramError: Listing the problems found.
    """
    problems = _check_static(program) + _check_overlapped(program)
    if not problems:
        problems = _check_communication(program)
    if not problems:
        problems = _check_execution(program)
    if problems:
        shown = problems[:20]
        more = f"\n... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise PipelineProgramError("invalid pipeline program:\n" + "\n".join(shown) + more)


def _check_static(program: PipelineProgram) -> list[str]:
    problems: list[str] = []
    n_ranks, n_stages, n_mb = program.num_ranks, program.num_stages, program.num_microbatches
    if n_mb < 1:
        problems.append(f"num_microbatches must be >= 1, got {n_mb}")
    for stage, rank in enumerate(program.stage_to_rank):
        if not 0 <= rank < n_ranks:
            problems.append(f"stage {stage} is placed on rank {rank}, outside the {n_ranks} ranks")
    if problems:
        return problems
    counts: Counter[tuple[ActionKind, int, int]] = Counter()
    for rank, acts in enumerate(program.actions):
        done: set[tuple[ActionKind, int, int]] = set()
        for action in acts:
            s, m = action.stage, action.microbatch
            if not 0 <= s < n_stages or not 0 <= m < n_mb:
                problems.append(f"{_where(rank, action)}: stage or microbatch out of range")
                continue
            if action.kind.is_compute:
                if program.stage_to_rank[s] != rank:
                    problems.append(
                        f"{_where(rank, action)}: stage {s} lives on rank {program.stage_to_rank[s]}"
                    )
                counts[(action.kind, s, m)] += 1
                if action.kind != ActionKind.FORWARD and not program.training:
                    problems.append(f"{_where(rank, action)}: backward in a forward-only program")
                if action.kind != ActionKind.FORWARD and (ActionKind.FORWARD, s, m) not in done:
                    problems.append(f"{_where(rank, action)}: runs before the forward F{s}.{m}")
                if (
                    action.kind == ActionKind.BACKWARD_WEIGHT
                    and (ActionKind.BACKWARD_INPUT, s, m) not in done
                ):
                    problems.append(f"{_where(rank, action)}: runs before the input backward I{s}.{m}")
                done.add((action.kind, s, m))
            else:
                if action.peer is None or not 0 <= action.peer < n_ranks or action.peer == rank:
                    problems.append(f"{_where(rank, action)}: invalid peer {action.peer}")
                    continue
                if action.kind == ActionKind.SEND_ACTIVATION and (ActionKind.FORWARD, s, m) not in done:
                    problems.append(f"{_where(rank, action)}: sends before the forward F{s}.{m} produced it")
                if action.kind == ActionKind.SEND_GRAD and not (
                    (ActionKind.BACKWARD, s, m) in done or (ActionKind.BACKWARD_INPUT, s, m) in done
                ):
                    problems.append(
                        f"{_where(rank, action)}: sends before the backward of stage {s} produced it"
                    )
    for s in range(n_stages):
        for m in range(n_mb):
            f = counts[(ActionKind.FORWARD, s, m)]
            if f != 1:
                problems.append(f"stage {s}, microbatch {m}: forward runs {f} times (expected once)")
            if not program.training:
                continue
            b, i, w = (
                counts[(k, s, m)]
                for k in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
            )
            if not ((b, i, w) == (1, 0, 0) or (b, i, w) == (0, 1, 1)):
                problems.append(
                    f"stage {s}, microbatch {m}: backward runs B={b} I={i} W={w} times "
                    "(expected one B, or one I and one W)"
                )
    return problems


def _check_overlapped(program: PipelineProgram) -> list[str]:
    problems: list[str] = []
    where = program.stage_to_rank
    for action in sorted(program.overlapped, key=str):
        rank = where[action.stage] if 0 <= action.stage < program.num_stages else -1
        acts = program.actions[rank] if 0 <= rank < program.num_ranks else ()
        if action.kind != ActionKind.FORWARD or action not in acts:
            problems.append(f"overlapped action {action} is not a forward of the program")
            continue
        i = acts.index(action)
        after = acts[i + 1] if i + 1 < len(acts) else None
        if after is None or not after.kind.is_backward or after.stage == action.stage:
            problems.append(
                f"{_where(rank, action)}: is overlapped but is not directly followed by a backward "
                f"(B or I) of another stage (next: {after})"
            )
    return problems


def _check_communication(program: PipelineProgram) -> list[str]:
    problems: list[str] = []
    posted: dict[tuple[int, int], list[Action]] = {}  # (sender, receiver) -> expected receives in send order
    received: dict[tuple[int, int], list[Action]] = {}  # (sender, receiver) -> receives in post order
    for rank, acts in enumerate(program.actions):
        for action in acts:
            if action.kind.is_send:
                posted.setdefault((rank, action.peer_rank), []).append(action.matching(own_rank=rank))
            elif action.kind.is_recv:
                received.setdefault((action.peer_rank, rank), []).append(action)
    for pair in sorted(set(posted) | set(received)):
        sender, receiver = pair
        sends, recvs = posted.get(pair, []), received.get(pair, [])
        for missing in Counter(sends) - Counter(recvs):
            send = missing.matching(own_rank=receiver)
            problems.append(f"{_where(sender, send)}: no matching receive on rank {receiver}")
        for missing in Counter(recvs) - Counter(sends):
            problems.append(f"{_where(receiver, missing)}: no matching send on rank {sender}")
        if not problems and sends != recvs:
            for k, (want, got) in enumerate(zip(sends, recvs, strict=True)):
                if want != got:
                    problems.append(
                        f"{_where(receiver, got)}: receive #{k} from rank {sender} is posted where the "
                        f"sender's #{k} message is for {want} (receives must follow the send order)"
                    )
                    break
    return problems


def _local_input_ready(
    program: PipelineProgram, action: Action, done: set[tuple[ActionKind, int, int]]
) -> bool:
    s, m, where = action.stage, action.microbatch, program.stage_to_rank
    if action.kind == ActionKind.FORWARD and s > 0 and where[s - 1] == where[s]:
        return (ActionKind.FORWARD, s - 1, m) in done
    if action.kind.is_backward and s + 1 < program.num_stages and where[s + 1] == where[s]:
        return (ActionKind.BACKWARD, s + 1, m) in done or (ActionKind.BACKWARD_INPUT, s + 1, m) in done
    return True


def _check_execution(program: PipelineProgram) -> list[str]:
    problems: list[str] = []
    for rank, acts in enumerate(program.actions):
        seen: set[Action] = set()
        for action in acts:
            if action.kind.is_recv:
                seen.add(action)
            elif action.kind.is_compute:
                need = receive_needed(action, program, rank)
                if need is not None and need not in seen:
                    problems.append(
                        f"{_where(rank, action)}: reads data from rank {need.peer} "
                        f"but no receive {need} precedes it"
                    )
    if problems:
        return problems
    pointer = [0] * program.num_ranks
    sent: set[tuple[int, Action]] = set()  # (receiver, expected receive)
    done: set[tuple[ActionKind, int, int]] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank, acts in enumerate(program.actions):
            while pointer[rank] < len(acts):
                action = acts[pointer[rank]]
                if action.kind.is_recv and (rank, action) not in sent:
                    break
                if action.kind.is_compute and not _local_input_ready(program, action, done):
                    break
                if action.kind.is_send:
                    sent.add((action.peer_rank, action.matching(own_rank=rank)))
                if action.kind.is_compute:
                    done.add((action.kind, action.stage, action.microbatch))
                pointer[rank] += 1
                progressed = True
    for rank, acts in enumerate(program.actions):
        if pointer[rank] < len(acts):
            action = acts[pointer[rank]]
            what = (
                f"waits for rank {action.peer} to send"
                if action.kind.is_recv
                else "waits for data from a local stage that never comes"
            )
            problems.append(f"{_where(rank, action)}: deadlock, {what}")
    return problems
