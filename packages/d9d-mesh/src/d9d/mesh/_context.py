"""The distributed context of a job: device, process groups, ranks and mesh domains."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from collections.abc import Callable, Generator, MutableMapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from d9d.mesh._domains import BATCH_DOMAIN, MeshDomain, domain_layout
from d9d.mesh._dtensor_caches import clear_dtensor_caches
from d9d.mesh._group_cache import ProcessGroupCache, partition_along
from d9d.mesh._nccl_environment import apply_nccl_defaults
from d9d.mesh._parameters import MeshParameters
from d9d.mesh._seeding import derived_seed, seed_everything

DeviceType = Literal["cpu", "cuda"]

DEFAULT_TIMEOUT = timedelta(minutes=10)


class _RankLogger(logging.LoggerAdapter[logging.Logger]):
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[rank {self.extra['rank'] if self.extra else '?'}] {msg}", kwargs


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from e


class DistributedContext:
    """Device, process groups and mesh domains of one process of a job.

    Built once per process from ``MeshParameters``. Under ``torchrun`` it reads ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; without them it forms a world of one
    process with a real process group, so the same model-provider code runs in both cases. If a
    default process group already exists (tests, or a launcher that made it), it is used as is.

    The device is chosen here and nowhere else: CUDA with NCCL when CUDA is available, else CPU
    with gloo, unless ``device_type`` forces one.
    """

    def __init__(
        self,
        parameters: MeshParameters,
        *,
        device_type: DeviceType | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        """Validates the layout against the world, then starts (or joins) the process group.

        Args:
            parameters: Parallelism degrees; their product must equal the world size.
            device_type: Force ``"cpu"`` or ``"cuda"``; auto-detected when None.
            timeout: Timeout of every collective; a hung collective fails after it. On NCCL
                the process then ends about 4 s later (``NCCL_ENVIRONMENT_DEFAULTS``, set
                here unless the user set them).

        Raises:
            ValueError: If the layout does not match the world size (before any group starts).
        """
        self._parameters = parameters
        self._device_type: DeviceType = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if self._device_type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device_type='cuda' was requested but CUDA is not available")
        self._backend = "nccl" if self._device_type == "cuda" else "gloo"
        self._timeout = timeout
        self._meshes: dict[MeshDomain, DeviceMesh] = {}
        self._groups = ProcessGroupCache(timeout=timeout)
        self._background_group: ProcessGroup | None = None
        self._excepthook_before = sys.excepthook
        if self._backend == "nccl":
            # Before any group this context makes: a timed-out collective then tears the process
            # down (instead of the wait returning wrong values) 4 s after torch's watchdog caught
            # it (instead of 60 s), unless the user set these variables (_nccl_environment.py).
            apply_nccl_defaults(os.environ)

        if dist.is_initialized():
            world_size = dist.get_world_size()
            parameters.check_world_size(world_size)
            self._owns_process_group = False
            # A group made before this context (a launcher, a test harness) obeys `timeout` too.
            self.set_timeout(timeout)
            self._rank = dist.get_rank()
            self._local_rank = _env_int("LOCAL_RANK", self._rank)
            self._local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
        else:
            world_size = _env_int("WORLD_SIZE", 1)
            parameters.check_world_size(world_size)
            self._rank = _env_int("RANK", 0)
            self._local_rank = _env_int("LOCAL_RANK", 0)
            self._local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
            self._owns_process_group = True
            self._start_process_group(world_size)

        if self._device_type == "cuda":
            torch.cuda.set_device(self._local_rank)
            self._device = torch.device("cuda", self._local_rank)
        else:
            self._device = torch.device("cpu")
        self._world_size = world_size
        self._logger = _RankLogger(logging.getLogger("d9d"), {"rank": self._rank})

    def _start_process_group(self, world_size: int) -> None:
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(
                backend=self._backend, timeout=self._timeout, rank=self._rank, world_size=world_size
            )
        else:
            # A world of one without torchrun: an in-memory store needs no address or port.
            dist.init_process_group(
                backend=self._backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self._timeout
            )
        if world_size == 1:
            # torch prefixes every line of an uncaught traceback with "[rank0]: " once per group it
            # starts; in a world of one the prefix says nothing, so the hook stays as it was.
            sys.excepthook = self._excepthook_before

    @property
    def parameters(self) -> MeshParameters:
        """The parallelism degrees this context was built from."""
        return self._parameters

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._device

    @property
    def device_type(self) -> DeviceType:
        """``"cuda"`` or ``"cpu"``."""
        return self._device_type

    @property
    def backend(self) -> str:
        """The process-group backend (``"nccl"`` or ``"gloo"``)."""
        return self._backend

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """Number of processes on this node."""
        return self._local_world_size

    @property
    def node_rank(self) -> int:
        """Index of this process's node."""
        return self._rank // max(self._local_world_size, 1)

    @property
    def num_nodes(self) -> int:
        """Number of nodes in the job."""
        return max(self._world_size // max(self._local_world_size, 1), 1)

    @property
    def is_main_process(self) -> bool:
        """Whether this is global rank 0."""
        return self._rank == 0

    @property
    def logger(self) -> logging.LoggerAdapter[logging.Logger]:
        """Logger of the ``d9d`` hierarchy whose messages carry this rank."""
        return self._logger

    @property
    def timeout(self) -> timedelta:
        """Current collective timeout."""
        return self._timeout

    def mesh_for(self, domain: MeshDomain) -> DeviceMesh:
        """Returns the device mesh of ``domain``, building it on first use.

        Every process must ask for a domain the first time in the same order, since building a
        mesh may create process groups collectively. Mesh dims that split the ranks the same way
        as a dim of an earlier domain reuse its process groups.
        """
        mesh = self._meshes.get(domain)
        if mesh is None:
            layout = domain_layout(domain, self._parameters)
            groups = [self._groups.group(partition_along(layout.ranks, d)) for d in range(layout.ranks.ndim)]
            mesh = DeviceMesh.from_group(
                groups, self._device_type, mesh=layout.ranks, mesh_dim_names=layout.dim_names
            )
            self._meshes[domain] = mesh
        return mesh

    @property
    def process_groups_created(self) -> int:
        """Distinct rank partitions for which the domains built so far created process groups."""
        return self._groups.created

    @property
    def pipeline_rank(self) -> int:
        """This process's coordinate on the ``pp`` dim."""
        return self._rank // self._parameters.ranks_per_stage

    @property
    def data_parallel_rank(self) -> int:
        """This process's coordinate on the ``dp`` dim of the batch domain (its data shard).

        Computed from the rank alone (no mesh is built, nothing collective happens).
        """
        p = self._parameters
        return (self._rank // (p.context_parallel * p.tensor_parallel)) % p.data_parallel

    def pipeline_group(self) -> ProcessGroup:
        """The group of this rank's pipeline (one rank per stage), for point-to-point transfers."""
        return self.mesh_for(BATCH_DOMAIN).get_group("pp")

    def world_group(self) -> ProcessGroup:
        """The group of every rank (loss and metric reductions)."""
        group = dist.group.WORLD
        if not isinstance(group, ProcessGroup):
            raise RuntimeError("the default process group is not initialized")
        return group

    def stage_group(self) -> ProcessGroup:
        """The group of every rank holding this rank's pipeline stage(s): all ranks but other stages'.

        A stage's parameters are sharded and replicated only within it, so whatever reads or
        writes one whole stage (an export) collects over this group.
        """
        per_stage, stages = self._parameters.ranks_per_stage, self._parameters.pipeline_parallel
        partition = tuple(tuple(range(s * per_stage, (s + 1) * per_stage)) for s in range(stages))
        return self._groups.group(partition)

    def background_group(self) -> ProcessGroup:
        """A gloo group of every rank for work that runs beside training (asynchronous checkpoints).

        Its collectives may run in a background thread without interleaving with the training
        step's; it obeys the context's timeout like every other group. Created collectively on
        the first call (every rank must call it at the same point), then cached.
        """
        if self._background_group is None:
            group = dist.new_group(backend="gloo", timeout=self._timeout)
            if not isinstance(group, ProcessGroup):
                raise RuntimeError(f"rank {self._rank} is not part of the background process group")
            self._background_group = group
        return self._background_group

    def barrier(self) -> None:
        """Waits until every process reaches this point."""
        dist.barrier()

    @contextmanager
    def main_process_first(self) -> Generator[None]:
        """Runs the body on the main process first, then on the others (e.g. downloads)."""
        if not self.is_main_process:
            dist.barrier()
        try:
            yield
        finally:
            if self.is_main_process:
                dist.barrier()

    def set_timeout(self, timeout: timedelta) -> None:
        """Changes the timeout of the world group and of every domain's groups.

        A collective that does not finish within ``timeout`` raises instead of hanging.
        """
        # Newer torch has a public setter for a live group's timeout (torch.distributed.set_timeout);
        # older releases (2.11) only the private one it replaced.
        setter = dist.__dict__.get("set_timeout") or dist.distributed_c10d.__dict__["_set_pg_timeout"]
        set_pg_timeout = cast(Callable[[timedelta, ProcessGroup | None], None], setter)
        set_pg_timeout(timeout, None)
        for mesh in self._meshes.values():
            for group in mesh.get_all_groups():
                set_pg_timeout(timeout, group)
        if self._background_group is not None:
            set_pg_timeout(timeout, self._background_group)
        self._timeout = timeout

    def seed(self, seed: int) -> int:
        """Seeds every generator; pipeline stages get distinct seeds, other ranks share one.

        Ranks of one stage (data, tensor, context, expert parallel) draw the same numbers, so
        parameters initialized as DTensors agree; stages differ so their layers do not repeat.

        Returns:
            The seed used on this rank.
        """
        stage_seed = derived_seed(seed, self.pipeline_rank)
        seed_everything(stage_seed)
        return stage_seed

    def close(self) -> None:
        """Destroys the process group if this context created it, and lets go of every group.

        torch ends a group's backend (gloo's worker threads) only when the last reference to the
        group goes, not at ``destroy_process_group``. A worker still alive when the interpreter
        finalizes aborts the process (``terminate called without an active exception``) if it is
        just finishing a collective, whose tensors it can release only with the GIL. So after
        destroying the groups the context empties torch's DTensor caches (they hold every mesh a
        DTensor ran on, and a mesh its groups) and has garbage collected at exit, before
        finalization: what still holds groups then (a closed trainer's model, in reference
        cycles) is freed, and each group's destructor joins its workers while they can still
        take the GIL. An object kept alive to the end (a global holding the model) keeps its
        groups alive.
        """
        self._meshes.clear()
        self._groups.clear()
        self._background_group = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            # The next group (a second context in this process) would wrap torch's rank-prefixing
            # hook again: "[rank0]: [rank0]: ..." on every line.
            sys.excepthook = self._excepthook_before
            clear_dtensor_caches()
            atexit.unregister(gc.collect)  # once per process, however many contexts closed
            atexit.register(gc.collect)
