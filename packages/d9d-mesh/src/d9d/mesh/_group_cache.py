"""Process groups shared between mesh domains, created once per distinct partition of the ranks."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

Partition = tuple[tuple[int, ...], ...]


def partition_along(ranks: torch.Tensor, dim: int) -> Partition:
    """The groups of ranks that differ only in their coordinate along ``dim``, sorted."""
    moved = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim])
    return tuple(sorted(tuple(sorted(int(r) for r in row)) for row in moved))


class ProcessGroupCache:
    """Hands out this rank's group of a partition, creating each distinct partition once.

    Domains are views of one rank layout, so many of their mesh dims split the ranks the same way
    (``pp`` in every domain, ``tp`` in three of them): those dims share process groups instead of
    creating new ones. The decision to create is taken per whole partition, which every rank
    sees identically, so all ranks enter the collective group creation together.
    """

    def __init__(self, *, timeout: timedelta) -> None:
        self._timeout = timeout
        self._groups: dict[Partition, ProcessGroup] = {}
        self._created = 0

    @property
    def created(self) -> int:
        """How many partitions needed new process groups."""
        return self._created

    def clear(self) -> None:
        """Drops every cached group (the count of created ones stays)."""
        self._groups.clear()

    def group(self, partition: Partition) -> ProcessGroup:
        """This rank's group within ``partition`` (collective the first time a partition is seen)."""
        cached = self._groups.get(partition)
        if cached is not None:
            return cached
        world = dist.get_world_size()
        group: object
        if len(partition) == 1 and len(partition[0]) == world:
            group = dist.group.WORLD
        else:
            group, _ = dist.new_subgroups_by_enumeration([list(p) for p in partition], timeout=self._timeout)
            self._created += 1
        if not isinstance(group, ProcessGroup):
            raise RuntimeError(f"rank {dist.get_rank()} got no process group for partition {partition}")
        self._groups[partition] = group
        return group
