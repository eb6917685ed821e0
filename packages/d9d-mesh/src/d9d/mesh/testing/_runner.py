"""Runs a function on N CPU ranks with gloo, forked from the calling process."""

from __future__ import annotations

import importlib
import io
import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from d9d.mesh.testing._zygote import ZYGOTE_ENV, ask_zygote


class DistributedTestError(AssertionError):
    """One or more ranks failed or hung; the message holds each failing rank's traceback."""


@dataclass(frozen=True, kw_only=True)
class _RankOutcome:
    rank: int
    ok: bool
    value: Any = None
    traceback: str = ""
    joined: bool = True  # False: init_process_group itself failed, ``fn`` never ran
    # True: gloo's TCP rendezvous of a group that ``fn`` created (``new_group``) failed on this rank
    subgroup_rendezvous_failed: bool = False


# gloo's error when the TCP connections of a group's members cannot all be made
_GLOO_RENDEZVOUS_FAILURE = "connectFullMesh failed"


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    collective_timeout: timedelta,
    conn: Connection,
) -> None:
    outcome: _RankOutcome
    try:
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
            }
        )
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        try:
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=collective_timeout
            )
            # gloo can finish its connections on one rank before its peer has; a rank whose ``fn``
            # returns at once would then close them under the peer ("Connection closed by peer").
            dist.barrier()
        except RuntimeError:
            outcome = _RankOutcome(rank=rank, ok=False, joined=False, traceback=traceback.format_exc())
        else:
            try:
                value = fn(*args, **kwargs)
            finally:
                dist.destroy_process_group()
            outcome = _RankOutcome(rank=rank, ok=True, value=value)
    except BaseException:
        report = traceback.format_exc()
        outcome = _RankOutcome(
            rank=rank,
            ok=False,
            traceback=report,
            subgroup_rendezvous_failed=_GLOO_RENDEZVOUS_FAILURE in report,
        )
    # Plain pickle copies tensors into the message; torch's multiprocessing pickler would share
    # their memory with a process that is about to exit.
    try:
        conn.send_bytes(pickle.dumps(outcome))
    except Exception:
        conn.send_bytes(pickle.dumps(_RankOutcome(rank=rank, ok=False, traceback=traceback.format_exc())))
    conn.close()
    # Skip interpreter teardown (atexit handlers inherited from the parent, e.g. pytest's).
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` CPU processes joined in a gloo group.

    Workers are forked, so a parent that has already imported torch starts a 4-rank world in
    about a second. Inside ``fn``, ``torch.distributed`` is initialized and ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set as torchrun would, so a
    ``DistributedContext`` can be built there. Return values must be picklable.

    Under pytest (d9d-mesh registers a plugin), ranks are forked from a clean process started
    after collection, because PyTorch forbids autograd in children of a process that already
    ran a backward pass; ``fn`` and its arguments are then pickled (module-level functions).
    When they cannot be pickled, or outside pytest, ranks are forked from the caller.

    Args:
        fn: The function every rank runs.
        *args: Positional arguments for ``fn``.
        world_size: Number of ranks.
        timeout_s: Wall-clock limit for the whole run; ranks still running then are killed.
        collective_timeout_s: Timeout of each collective inside the workers.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        ``fn``'s return value on each rank, in rank order.

    Raises:
        DistributedTestError: If any rank raised, exited abnormally or did not finish in time;
            the message names every such rank with its traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    request = _Request(
        fn=fn,
        args=args,
        kwargs=kwargs,
        world_size=world_size,
        timeout_s=timeout_s,
        collective_timeout_s=collective_timeout_s,
    )
    outcomes = _run_through_zygote(request)
    if outcomes is None:
        outcomes = _run_forked(request)
    failures = [o for o in outcomes if not o.ok]
    if failures:
        report = "\n".join(f"--- rank {o.rank} ---\n{o.traceback}" for o in failures)
        raise DistributedTestError(f"{len(failures)} of {world_size} ranks failed:\n{report}")
    return [o.value for o in outcomes]


@dataclass(frozen=True, kw_only=True)
class _Request:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    world_size: int
    timeout_s: float
    collective_timeout_s: float


def _module_by_name(name: str) -> types.ModuleType:
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


class _RequestPickler(pickle.Pickler):
    """Pickles modules (e.g. a test's conftest passed as a fixture) by name: the zygote has them."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            return _module_by_name, (obj.__name__,)
        return NotImplemented


def _run_through_zygote(request: _Request) -> list[_RankOutcome] | None:
    path = os.environ.get(ZYGOTE_ENV)
    if path is None:
        return None
    try:
        buffer = io.BytesIO()
        _RequestPickler(buffer).dump(request)
        payload = buffer.getvalue()
    except (pickle.PicklingError, AttributeError, TypeError):
        return None  # e.g. a closure: fork from the caller instead
    status, value = ask_zygote(path, payload, request.timeout_s + 60.0)
    if status != "ok":
        raise DistributedTestError(f"the d9d test zygote failed:\n{value}")
    return value


def handle_zygote_request(payload: bytes) -> bytes:
    """Runs a pickled request in the zygote's coordinator fork; returns the pickled outcomes."""
    request: _Request = pickle.loads(payload)
    return pickle.dumps(("ok", _run_forked(request)))


_WORLD_STARTS = 3


def _run_forked(request: _Request) -> list[_RankOutcome]:
    outcomes = _run_world(request)
    for _ in range(_WORLD_STARTS - 1):
        if not any(_rendezvous_failed(outcome) for outcome in outcomes):
            break
        # gloo's TCP rendezvous between forked ranks fails now and then on a busy host
        # ("connectFullMesh failed ... Connection closed by peer"), for the world group or for a
        # group that ``fn`` creates; the world starts once more, with a fresh store. A failure
        # that comes back three times is reported.
        outcomes = _run_world(request)
    return outcomes


def _rendezvous_failed(outcome: _RankOutcome) -> bool:
    return not outcome.joined or outcome.subgroup_rendezvous_failed


def _run_world(request: _Request) -> list[_RankOutcome]:
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="d9d-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        pipes: list[Connection] = []
        procs: list[BaseProcess] = []
        for rank in range(request.world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(
                    rank,
                    request.world_size,
                    store_path,
                    request.fn,
                    request.args,
                    request.kwargs,
                    timedelta(seconds=request.collective_timeout_s),
                    send,
                ),
                daemon=True,
            )
            proc.start()
            send.close()
            pipes.append(recv)
            procs.append(proc)
        return _collect(procs, pipes, request.timeout_s)


def _collect(procs: list[BaseProcess], pipes: list[Connection], timeout_s: float) -> list[_RankOutcome]:
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, _RankOutcome] = {}
    pending = set(range(len(procs)))
    while pending and time.monotonic() < deadline:
        for rank in sorted(pending):
            pipe = pipes[rank]
            if pipe.poll(0.01):
                try:
                    outcomes[rank] = pickle.loads(pipe.recv_bytes())
                except EOFError:
                    procs[rank].join(timeout=5)
                    outcomes[rank] = _RankOutcome(
                        rank=rank,
                        ok=False,
                        traceback=f"exited with code {procs[rank].exitcode} before reporting",
                    )
                pending.discard(rank)
            elif not procs[rank].is_alive() and not pipe.poll(0):
                outcomes[rank] = _RankOutcome(
                    rank=rank, ok=False, traceback=f"exited with code {procs[rank].exitcode} before reporting"
                )
                pending.discard(rank)
    for rank in pending:
        outcomes[rank] = _RankOutcome(
            rank=rank,
            ok=False,
            traceback=f"did not finish within {timeout_s:.0f} s (hung or too slow); killed",
        )
    for rank in pending:
        procs[rank].kill()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [outcomes[r] for r in range(len(procs))]
