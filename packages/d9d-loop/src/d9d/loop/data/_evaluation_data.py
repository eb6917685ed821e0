"""Held-out data for evaluation and inference: every sample once, every rank the same batch count."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from d9d.loop.data._auto_data import MapDataset
from d9d.mesh import DistributedContext, map_tree

SampleT = TypeVar("SampleT")
BatchT = TypeVar("BatchT")
TreeT = TypeVar("TreeT")


@dataclass(kw_only=True, frozen=True)
class EvaluationData(Generic[SampleT, BatchT]):
    """A map-style dataset read once in order (evaluation during training, inference).

    Attributes:
        dataset_factory: Builds the dataset once the distributed context exists.
        collator: Turns a list of samples into a batch (as for training).
    """

    dataset_factory: Callable[[DistributedContext], MapDataset[SampleT]]
    collator: Callable[[list[SampleT]], BatchT]


@dataclass(kw_only=True, frozen=True)
class PaddedBatch(Generic[BatchT]):
    """A rank's batch of ``local_batch_size`` samples, of which the first ``real`` are real.

    The rest repeat the dataset's last sample so that every rank runs the same forwards (FSDP and
    pipeline collectives need it); their outputs are dropped before loss, metrics and outputs.
    """

    batch: BatchT
    real: int


def padded_batches(
    data: EvaluationData[Any, BatchT],
    dataset: MapDataset[Any],
    *,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[PaddedBatch[BatchT]]:
    """This rank's batches of one pass: batch ``k`` of rank ``r`` holds samples
    ``[k*G + r*B, k*G + (r+1)*B)`` (``B`` local, ``G = B * dp_size``), padded past the end."""
    n = len(dataset)
    if n == 0:
        raise ValueError("the evaluation dataset is empty")
    global_batch = local_batch_size * dp_size
    for k in range((n + global_batch - 1) // global_batch):
        start = k * global_batch + dp_rank * local_batch_size
        indices = [min(i, n - 1) for i in range(start, start + local_batch_size)]
        real = max(0, min(local_batch_size, n - start))
        yield PaddedBatch(batch=data.collator([dataset[i] for i in indices]), real=real)


def first_rows(tree: TreeT, count: int) -> TreeT:
    """The first ``count`` entries along dim 0 of every tensor of a tree (outputs are batch-major)."""
    return map_tree(tree, lambda t, _path: t[:count])


def real_rows_per_microbatch(real: int, *, local_batch_size: int, num_microbatches: int) -> list[int]:
    """How many real samples each of the equal microbatches of a padded batch holds."""
    size = local_batch_size // num_microbatches
    return [max(0, min(size, real - i * size)) for i in range(num_microbatches)]
