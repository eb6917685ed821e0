"""A data provider for map-style datasets: seeded order, sharded over data-parallel ranks, resumable."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
from torch.utils.data import DataLoader, Dataset

from d9d.loop._providers import BatchSource, DataProviderContext
from d9d.loop.config._data import DataConfig
from d9d.mesh import DistributedContext, derived_seed

SampleT = TypeVar("SampleT")
SampleT_co = TypeVar("SampleT_co", covariant=True)
BatchT = TypeVar("BatchT")


class MapDataset(Protocol[SampleT_co]):
    """A map-style dataset: ``len`` and integer indexing (``torch.utils.data.Dataset`` fits)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> SampleT_co: ...


class _TorchDataset(Dataset[SampleT]):
    """Presents any map-style dataset as a ``torch.utils.data.Dataset`` for worker processes."""

    def __init__(self, dataset: MapDataset[SampleT]) -> None:
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> SampleT:
        return self._dataset[index]


class ShardedBatchSource(Generic[SampleT, BatchT]):
    """Batches of a map-style dataset for one data-parallel rank.

    Each epoch visits the samples in one order (seeded, the same on every rank, new per epoch when
    shuffling); step ``k`` of an epoch takes samples ``[k * G, (k + 1) * G)`` of that order for a
    global batch ``G``, and rank ``r`` of ``D`` takes the ``r``-th of ``D`` equal slices of them. A
    partial last global batch is dropped. The saved state is ``(epoch, step in epoch)``, with the
    global batch it counts in and ``source``, what the data is (``source`` when given, else its
    number of samples), so a resume on other data says so.
    """

    def __init__(
        self,
        *,
        dataset: MapDataset[SampleT],
        collator: Callable[[list[SampleT]], BatchT],
        config: DataConfig,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        source: str | None = None,
    ) -> None:
        if global_batch_size % dp_size != 0:
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by data-parallel size {dp_size}"
            )
        self._dataset = dataset
        self._source = source if source is not None else f"{len(dataset)} samples"
        self._collator = collator
        self._config = config
        self._global = global_batch_size
        self._local = global_batch_size // dp_size
        self._offset = dp_rank * self._local
        self._steps_per_epoch = len(dataset) // global_batch_size
        if self._steps_per_epoch == 0:
            raise ValueError(
                f"dataset of {len(dataset)} samples is smaller than the global batch ({global_batch_size})"
            )
        self._epoch = 0
        self._step_in_epoch = 0
        self._iterator: Iterator[BatchT] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self._steps_per_epoch

    def _order(self, epoch: int) -> list[int]:
        n = len(self._dataset)
        if not self._config.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(derived_seed(epoch, self._config.seed))
        return cast(list[int], torch.randperm(n, generator=generator).tolist())

    def _start_epoch_iterator(self) -> Iterator[BatchT]:
        order = self._order(self._epoch)
        used = order[: self._steps_per_epoch * self._global]
        batches = [
            used[step * self._global + self._offset : step * self._global + self._offset + self._local]
            for step in range(self._step_in_epoch, self._steps_per_epoch)
        ]
        if self._config.num_workers == 0:
            return (self._collator([self._dataset[i] for i in indices]) for indices in batches)
        loader: DataLoader[SampleT] = DataLoader(
            _TorchDataset(self._dataset),
            batch_sampler=batches,
            collate_fn=self._collator,
            num_workers=self._config.num_workers,
            pin_memory=self._config.pin_memory,
        )
        batches_iter: Iterator[BatchT] = iter(loader)  # collate_fn makes batches
        return batches_iter

    def next_batch(self) -> BatchT:
        if self._step_in_epoch >= self._steps_per_epoch:
            self._epoch += 1
            self._step_in_epoch = 0
            self._iterator = None
        if self._iterator is None:
            self._iterator = self._start_epoch_iterator()
        batch = next(self._iterator)
        self._step_in_epoch += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The next batch's position (``epoch``, ``step_in_epoch``), its global batch, the data."""
        return {
            "epoch": self._epoch,
            "step_in_epoch": self._step_in_epoch,
            "global_batch_size": self._global,
            "source": self._source,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues at the saved position, converted in samples when the global batch changed.

        Raises:
            ValueError: If the samples already consumed in the epoch are not a whole number of
                this run's global batches, naming both batch sizes.
        """
        self._epoch = int(state["epoch"])
        step_in_epoch = int(state["step_in_epoch"])
        saved_global = int(state.get("global_batch_size", self._global))
        if saved_global != self._global:
            samples = step_in_epoch * saved_global
            if samples % self._global != 0:
                raise ValueError(
                    f"cannot resume the data position: the checkpoint consumed {samples} samples of "
                    f"epoch {self._epoch} with trainer.global_batch_size={saved_global}, not a whole "
                    f"number of batches of this run's trainer.global_batch_size={self._global}"
                )
            step_in_epoch = samples // self._global
        self._step_in_epoch = step_in_epoch
        self._iterator = None


class AutoDataProvider(Generic[SampleT, BatchT]):
    """Shards a map-style dataset across data-parallel ranks, resumable at the exact sample.

    Args:
        dataset_factory: Builds the dataset (called once per rank, with the distributed context).
        collator: Turns a list of samples into a batch.
        config: Order, seed and worker settings.
    """

    def __init__(
        self,
        *,
        dataset_factory: Callable[[DistributedContext], MapDataset[SampleT]],
        collator: Callable[[list[SampleT]], BatchT],
        config: DataConfig,
    ) -> None:
        self._dataset_factory = dataset_factory
        self._collator = collator
        self._config = config

    def build(self, context: DataProviderContext) -> BatchSource[BatchT]:
        return ShardedBatchSource(
            dataset=self._dataset_factory(context.dist_context),
            collator=self._collator,
            config=self._config,
            global_batch_size=context.global_batch_size,
            dp_rank=context.dp_rank,
            dp_size=context.dp_size,
        )
