"""Batched asynchronous point-to-point transport over a process group."""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from d9d.pipeline._actions import Action


class _Batch:
    """The works of one posted batch, waited at most once (a gloo work must not be waited twice)."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()


class _P2PRecv:
    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.batch: _Batch | None = None

    def wait(self) -> list[torch.Tensor]:
        if self.batch is None:
            raise RuntimeError("receive waited before it was posted")
        self.batch.wait()
        return self.buffers


class P2PTransport:
    """Collects a run of sends and receives and posts each as one ``batch_isend_irecv``.

    Sends and receives go in separate batches: a receive is waited right before the compute that
    reads it, a send only at the end of the step, so a slow peer never blocks this rank's sends;
    sends found finished at a later flush are released early, freeing their tensors.
    """

    def __init__(self, *, group: ProcessGroup, global_ranks: list[int]) -> None:
        self._group = group
        self._global = global_ranks
        self._send_ops: list[dist.P2POp] = []
        self._recv_ops: list[dist.P2POp] = []
        self._recvs: list[_P2PRecv] = []
        self._send_works: deque[dist.Work] = deque()

    def _peer(self, action: Action) -> int:
        if action.peer is None:
            raise ValueError(f"communication action {action} has no peer")
        return self._global[action.peer]

    def send(self, action: Action, tensors: list[torch.Tensor]) -> None:
        peer = self._peer(action)
        self._send_ops += [dist.P2POp(dist.isend, t, peer, self._group) for t in tensors]

    def recv(self, action: Action, buffers: list[torch.Tensor]) -> _P2PRecv:
        peer = self._peer(action)
        self._recv_ops += [dist.P2POp(dist.irecv, b, peer, self._group) for b in buffers]
        handle = _P2PRecv(buffers)
        self._recvs.append(handle)
        return handle

    def flush(self) -> None:
        # Drop finished sends so their tensors can be freed before the end of the step. Sends
        # finish about in posting order: stopping at the first unfinished one keeps this O(1)
        # per flush instead of a scan of every pending send at every compute action.
        works = self._send_works
        while works and works[0].is_completed():
            works.popleft()
        if self._send_ops:
            works.extend(dist.batch_isend_irecv(self._send_ops))
            self._send_ops = []
        if self._recvs:  # a receive of no tensors has a handle but no ops (an empty batch)
            batch = _Batch(list(dist.batch_isend_irecv(self._recv_ops)) if self._recv_ops else [])
            self._recv_ops = []
            for handle in self._recvs:
                handle.batch = batch
            self._recvs = []

    def finish(self) -> None:
        works = self._send_works
        while works:
            works.popleft().wait()
