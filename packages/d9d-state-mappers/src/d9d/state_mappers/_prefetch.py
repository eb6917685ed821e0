"""Reading ahead on a background thread, so that file reads overlap with mapping and writing."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch

from d9d.state_mappers._checkpoint_reader import SafetensorsCheckpoint
from d9d.state_mappers._spec import Box, box_numel, box_shape

DEFAULT_READ_AHEAD_BYTES = 128 * 2**20


class Prefetcher:
    """Reads ``(name, box)`` slices in the given order, at most ``max_bytes`` ahead of the consumer.

    One slice larger than the limit is still read, alone. File reads release the GIL, so they
    proceed while the consumer computes. Call ``close`` when done (or on failure).
    """

    def __init__(
        self,
        checkpoint: SafetensorsCheckpoint,
        reads: Sequence[tuple[str, Box]],
        *,
        max_bytes: int = DEFAULT_READ_AHEAD_BYTES,
    ) -> None:
        self._checkpoint = checkpoint
        self._reads = list(reads)
        specs = checkpoint.specs
        self._sizes = [specs[name].dtype.itemsize * box_numel(box) for name, box in self._reads]
        self._max_bytes = max_bytes
        self._ahead = 0
        self._stop = False
        self._condition = threading.Condition()
        self._ready: queue.Queue[torch.Tensor | BaseException] = queue.Queue()
        self._next = 0
        self._thread = threading.Thread(target=self._run, name="d9d-checkpoint-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for index, (name, box) in enumerate(self._reads):
            size = self._sizes[index]
            with self._condition:
                while not self._stop and self._ahead > 0 and self._ahead + size > self._max_bytes:
                    self._condition.wait()
                if self._stop:
                    return
                self._ahead += size
            try:
                self._ready.put(self._checkpoint.read(name, box))
            except BaseException as error:
                self._ready.put(error)
                return

    def next(self, name: str) -> torch.Tensor:
        """The next slice in order; ``name`` must be the next name planned."""
        expected, box = self._reads[self._next]
        if name != expected:
            raise RuntimeError(f"read-ahead out of order: asked for {name!r}, next planned is {expected!r}")
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        with self._condition:
            self._ahead -= self._sizes[self._next]
            self._condition.notify_all()
        self._next += 1
        if tuple(item.shape) != box_shape(box):
            raise RuntimeError(
                f"read-ahead returned shape {tuple(item.shape)} for {name!r}, expected {box_shape(box)}"
            )
        return item

    def close(self) -> None:
        """Stops reading ahead and waits for the thread to finish its current read."""
        with self._condition:
            self._stop = True
            self._condition.notify_all()
        self._thread.join()
