"""Writing behind on a background thread, so that disk writes overlap with reading and mapping."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

DEFAULT_WRITE_BEHIND_BYTES = 256 * 2**20


class BackgroundWriter:
    """Runs write jobs in order on one thread, holding at most ``max_bytes`` of queued data.

    ``submit`` blocks while the queue is full (one job larger than the limit still runs, alone).
    The first failure is kept: later jobs are skipped and ``submit``/``drain`` raise it.
    """

    def __init__(self, *, max_bytes: int = DEFAULT_WRITE_BEHIND_BYTES) -> None:
        self._max_bytes = max_bytes
        self._pending = 0
        self._error: BaseException | None = None
        self._condition = threading.Condition()
        self._jobs: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="d9d-checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, size = item
            try:
                if self._error is None:
                    job()
            except BaseException as error:
                self._error = error
            with self._condition:
                self._pending -= size
                self._condition.notify_all()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"background write failed: {self._error}") from self._error

    def submit(self, job: Callable[[], None], size: int) -> None:
        """Queues ``job`` (holding ``size`` bytes until it ran)."""
        size = max(size, 1)  # every queued job counts, so that drain waits for it
        with self._condition:
            while self._error is None and self._pending > 0 and self._pending + size > self._max_bytes:
                self._condition.wait()
            self._raise_failure()
            self._pending += size
        self._jobs.put((job, size))

    def drain(self) -> None:
        """Waits until every queued job ran; raises the first failure."""
        with self._condition:
            while self._pending > 0:
                self._condition.wait()
        self._raise_failure()

    def close(self) -> None:
        """Finishes queued jobs (skipping them after a failure) and stops the thread."""
        self._jobs.put(None)
        self._thread.join()
