"""Refuses optimizer moments offloaded to a host that cannot hold them, before any weight loads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from d9d.loop._auto_optimizer import kernels_name
from d9d.loop.estimate._estimate import RankEstimate
from d9d.loop.estimate._job import MemoryJob


class _HostCheck(Protocol):
    """d9d-kernels' ``HostStateOffload``, as far as this check uses it."""

    def check_fits(self, needed_bytes: int, *, what: str) -> None: ...


def check_host_fits(job: MemoryJob, estimates: Sequence[RankEstimate], *, processes_per_host: int) -> None:
    """Refuses an offloading job whose largest rank's moments exceed its share of the host's memory.

    The same check the optimizer makes when it is built, made here from the model's shape so that
    it fails before the weights load.

    Raises:
        ValueError: Naming the bytes needed and available.
    """
    optimizer = job.optimizer
    if not optimizer.offloaded:
        return
    trained = max(e.components["weights, trained"] for e in estimates) // job.model.storage_bytes
    needed = max(0, trained * optimizer.state_bytes - optimizer.resident_bytes)
    check = cast(_HostCheck, kernels_name("HostStateOffload")(processes_per_host=processes_per_host))
    check.check_fits(needed, what="optimizer.offload (from the model's shape, before loading)")
