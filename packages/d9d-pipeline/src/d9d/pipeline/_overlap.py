"""Overlapped forward/backward pairs: a forward and a backward of two stages taking turns.

DualPipeV pairs a forward of one stage with a backward of the other stage on the same rank, so
that one's communication (expert-parallel all-to-all, FSDP gathers) runs while the other computes.
The pair runs as two threads that never run at the same time: the forward on the calling thread,
the backward on a helper thread (one per runner, kept between pairs). They hand the turn to each
other at *overlap points*: in the forward where the stage calls the point it was given
(:class:`OverlapPoints`, e.g. between decoder layers), in the backward where autograd reaches the
graph nodes recorded at those points when that microbatch ran forward. Both halves therefore
issue their work, collectives included, in an order fixed by the program and the model alone, the
same on every rank. On CUDA each stage of a pair runs on its own stream, so the GPU runs one
stage's kernels while the other's wait for communication. Where neither stage has overlap points,
the pair runs one after the other on the calling thread, still on the two streams.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch
from torch.autograd.graph import Node

OverlapPoint = Callable[[torch.Tensor], None]
"""Called by a stage's forward with the tensor that flows on at a point where an overlapped
backward may take its turn (e.g. the residual stream between two decoder layers)."""


@runtime_checkable
class OverlapPoints(Protocol):
    """A stage module that marks where an overlapped forward and backward may take turns.

    Without it the forward's half has no turns; where the backward's stage has none either, the
    pair runs one after the other on the calling thread (on CUDA still on two streams, so the
    GPU may run the backward's first kernels beside the forward's last).
    """

    def set_overlap_point(self, point: OverlapPoint | None) -> None:
        """Installs ``point`` (None removes it); the forward calls it at each overlap point."""
        ...


class Turns:
    """Lets two threads, the forward (side 0) and the backward (side 1), run one at a time."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._running = [True, True]

    def wait_for_turn(self, side: int) -> None:
        """Blocks until ``side`` may run."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn == side)

    def pass_turn(self, side: int) -> None:
        """At an overlap point of ``side``: lets the other side run to its next point, if it runs."""
        with self._cond:
            other = 1 - side
            if not self._running[other]:
                return
            self._turn = other
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == side)

    def finish(self, side: int) -> None:
        """``side`` is done: the other side runs to its end without handing the turn back."""
        with self._cond:
            self._running[side] = False
            self._turn = 1 - side
            self._cond.notify_all()


@contextmanager
def calls_at_nodes(nodes: list[Node], call: Callable[[], None]) -> Generator[None]:
    """Calls ``call`` whenever autograd is about to run one of ``nodes`` (the backward's points)."""

    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        del grad_outputs
        call()

    handles = [node.register_prehook(hook) for node in nodes]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_pair(
    forward: Callable[[], None], backward: Callable[[], None], turns: Turns, helper: ThreadPoolExecutor
) -> None:
    """Runs ``forward`` here and ``backward`` on ``helper``'s thread, taking turns; forward starts.

    Each callable passes the turn at its own points through ``turns`` (side 0 forward, side 1
    backward). An exception in either half lets the other half run to its end and is raised here
    after both halves have stopped (the forward's first). ``helper`` is a one-thread pool kept for
    many pairs: a backward on a new thread pays for the thread's start and its first autograd
    call (about a millisecond on CPU).
    """

    def run_backward() -> None:
        turns.wait_for_turn(1)
        try:
            backward()
        finally:
            turns.finish(1)

    done = helper.submit(run_backward)
    try:
        forward()
    finally:
        turns.finish(0)
        error = done.exception()  # waits for the backward
    if error is not None:
        raise error


def pair_helper() -> ThreadPoolExecutor:
    """The one-thread pool that runs the backward halves of a runner's pairs.

    Its thread takes the caller's intra-op thread count: OpenMP keeps that count per thread, and a
    new thread's default (every core) would add a second team of spinning workers.
    """
    return ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="d9d-pipeline-overlapped-backward",
        initializer=torch.set_num_threads,
        initargs=(torch.get_num_threads(),),
    )
