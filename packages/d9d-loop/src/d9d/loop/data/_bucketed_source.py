"""Batches of unpacked rows grouped by length, so that padding to the longest row wastes little."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, cast

import torch

from d9d.loop.data._rows import TokenRow
from d9d.mesh import derived_seed

BatchT = TypeVar("BatchT")


def bucketed_batches(
    lengths: list[int], *, global_batch_size: int, window_batches: int, generator: torch.Generator | None
) -> list[list[int]]:
    """Global batches of sample indices, each of similar lengths.

    The samples (in a seeded random order when ``generator`` is given) are cut into windows of
    ``window_batches`` global batches; each window is sorted by length and cut into batches;
    the batches are then put in a random order, so the step-to-step length still varies. A
    partial last batch is dropped; ``window_batches=1`` is plain (unbucketed) batching.
    """
    n = len(lengths)
    order = (
        list(range(n))
        if generator is None
        else cast(list[int], torch.randperm(n, generator=generator).tolist())
    )
    used = order[: n // global_batch_size * global_batch_size]
    window = window_batches * global_batch_size
    batches: list[list[int]] = []
    for start in range(0, len(used), window):
        chunk = sorted(used[start : start + window], key=lambda i: lengths[i], reverse=True)
        batches += [chunk[i : i + global_batch_size] for i in range(0, len(chunk), global_batch_size)]
    if generator is not None and window_batches > 1:
        batches = [
            batches[i] for i in cast(list[int], torch.randperm(len(batches), generator=generator).tolist())
        ]
    return batches


class BucketedBatchSource(Generic[BatchT]):
    """A ``BatchSource`` over in-memory rows of different lengths, batched by length bucket.

    Every rank computes the same global batches (seeded per epoch) and takes its slice, so the
    saved state, ``(epoch, step in epoch)``, is the same on every rank and a resume continues at
    the exact batch.

    Args:
        rows: The samples.
        collator: Pads a list of rows into a batch (e.g. ``PaddingCollator``).
        global_batch_size: Rows per step over all data-parallel ranks.
        dp_rank: This rank's data shard.
        dp_size: Number of data shards.
        window_batches: Global batches per length-sorting window (1: no bucketing).
        shuffle: A new seeded order each epoch (False: file order, still bucketed).
        seed: Seed of the order.
        source: What the data is, saved with the position (None: the number of rows).
    """

    def __init__(
        self,
        *,
        rows: list[TokenRow],
        collator: Callable[[list[TokenRow]], BatchT],
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        window_batches: int,
        shuffle: bool,
        seed: int,
        source: str | None = None,
    ) -> None:
        if global_batch_size % dp_size != 0:
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by data-parallel size {dp_size}"
            )
        if len(rows) < global_batch_size:
            raise ValueError(f"{len(rows)} samples are fewer than the global batch ({global_batch_size})")
        self._rows = rows
        self._source = source if source is not None else f"{len(rows)} rows"
        self._lengths = [len(row) for row in rows]
        self._collator = collator
        self._global = global_batch_size
        self._local = global_batch_size // dp_size
        self._offset = dp_rank * self._local
        self._window = window_batches
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._step_in_epoch = 0
        self._batches: list[list[int]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self._rows) // self._global

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The global batches of ``epoch`` (sample indices)."""
        generator = torch.Generator().manual_seed(derived_seed(epoch, self._seed)) if self._shuffle else None
        return bucketed_batches(
            self._lengths, global_batch_size=self._global, window_batches=self._window, generator=generator
        )

    def next_batch(self) -> BatchT:
        if self._step_in_epoch >= self.steps_per_epoch:
            self._epoch += 1
            self._step_in_epoch = 0
            self._batches = None
        if self._batches is None:
            self._batches = self.epoch_batches(self._epoch)
        indices = self._batches[self._step_in_epoch][self._offset : self._offset + self._local]
        self._step_in_epoch += 1
        return self._collator([self._rows[i] for i in indices])

    def state_dict(self) -> dict[str, Any]:
        """The next batch's position: ``epoch`` and ``step_in_epoch``, and what the data is (``source``)."""
        return {"epoch": self._epoch, "step_in_epoch": self._step_in_epoch, "source": self._source}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues at the saved batch."""
        self._epoch = int(state["epoch"])
        self._step_in_epoch = int(state["step_in_epoch"])
        self._batches = None
