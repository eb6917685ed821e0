"""Bucketed, asynchronous gradient reduction driven by gradient placements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement
from torch.utils.hooks import RemovableHandle


@dataclass(frozen=True)
class _BucketKey:
    mesh: DeviceMesh
    dims: tuple[int, ...]
    average: bool
    dtype: torch.dtype


@dataclass(kw_only=True)
class _Bucket:
    key: _BucketKey
    parameters: list[torch.Tensor] = field(default_factory=list[torch.Tensor])
    grads: list[DTensor] = field(default_factory=list[DTensor])
    nbytes: int = 0


@dataclass(kw_only=True)
class _Reduction:
    bucket: _Bucket
    flat: torch.Tensor
    work: dist.Work | None
    remaining_dims: list[int]


def _pending_dims(grad: DTensor, name: str) -> tuple[tuple[int, ...], bool]:
    dims: list[int] = []
    ops: set[str] = set()
    for index, placement in enumerate(grad.placements):
        if isinstance(placement, Partial):
            dims.append(index)
            ops.add(cast(str, placement.reduce_op))
    if not dims:
        return (), False
    if len(ops) != 1 or not ops <= {"sum", "avg"}:
        raise ValueError(
            f"gradient of parameter {name} is Partial with reduce ops {sorted(ops)}; "
            "GradientSynchronizer reduces only one of 'sum' or 'avg' per gradient"
        )
    return tuple(dims), ops == {"avg"}


class GradientSynchronizer:
    """Reduces gradients that are ``Partial`` DTensors, in buckets, overlapped with backward.

    A gradient's placements say what is pending: a ``Partial`` mesh dim (set by
    ``parallelize_replicate``, expert and sequence-parallel styles, or a user's strategy) is
    all-reduced over that dim's ranks (``"avg"`` divides by their count). Gradients are grouped
    by (mesh, pending dims, op, dtype) and packed into buckets of about ``bucket_size_mb``; each
    bucket is launched asynchronously from a post-accumulate-grad hook as soon as it is full, so
    communication runs while backward continues. After reduction a gradient gets its parameter's
    placements. Gradients that are plain tensors or have no ``Partial`` dim are left alone, among
    them those of parameters managed by ``fully_shard`` (FSDP reduce-scatters them itself; here
    only FSDP's gradient sync is toggled per microbatch).

    Use per step: ``begin_microbatch(is_last)`` before each microbatch's backward (reduction
    happens only in the last one's; earlier microbatches just accumulate), then ``finish()``
    after the last backward and before clipping or the optimizer step. Build it after the model
    is parallelized and materialized (it hooks the parameter objects that exist then).
    """

    def __init__(self, model: nn.Module, *, bucket_size_mb: float = 25.0) -> None:
        """Hooks every trainable DTensor parameter of ``model``.

        Args:
            model: The parallelized model (or pipeline stage).
            bucket_size_mb: Bucket size in MiB; a bucket is launched once it holds this much.
        """
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        self._bucket_bytes = int(bucket_size_mb * 2**20)
        self._fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._names: dict[int, str] = {}
        self._handles: list[RemovableHandle] = []
        for name, parameter in model.named_parameters():
            # FSDP's own parameters are hooked too: their gradients arrive reduce-scattered (no
            # Partial dim) and are only counted; parameters FSDP ignores are reduced here.
            if not parameter.requires_grad or not isinstance(parameter, DTensor):
                continue
            self._names[id(parameter)] = name
            handle = cast(RemovableHandle, parameter.register_post_accumulate_grad_hook(self._on_gradient))
            self._handles.append(handle)
        self._is_last = True
        self._seen = 0
        self._open: dict[_BucketKey, _Bucket] = {}
        self._in_flight: list[_Reduction] = []
        self._launched = 0

    @property
    def num_hooked_parameters(self) -> int:
        """How many parameters this synchronizer hooks (trainable DTensors)."""
        return len(self._names)

    @property
    def launched_buckets(self) -> int:
        """Buckets launched since the last ``begin_microbatch(is_last=True)``."""
        return self._launched

    @property
    def in_flight_buckets(self) -> int:
        """Buckets launched and not yet waited for."""
        return len(self._in_flight)

    def begin_microbatch(self, is_last: bool) -> None:
        """Call before each microbatch's backward; reduce only when ``is_last``.

        Also sets whether FSDP modules reduce-scatter in this backward.
        """
        self._is_last = is_last
        if is_last:
            self._seen = 0
            self._launched = 0
        for module in self._fsdp_modules:
            module.set_requires_gradient_sync(is_last, recurse=False)

    def finish(self) -> None:
        """Launches what is left and waits for every reduction; gradients are final afterwards."""
        self._launch_all()
        for reduction in self._in_flight:
            self._complete(reduction)
        self._in_flight.clear()
        self._seen = 0

    def close(self) -> None:
        """Waits for pending work, then removes the hooks."""
        self.finish()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_gradient(self, parameter: torch.Tensor) -> None:
        if not self._is_last:
            return
        self._seen += 1
        grad = parameter.grad
        if isinstance(grad, DTensor):
            dims, average = _pending_dims(grad, self._names.get(id(parameter), "?"))
            if dims:
                key = _BucketKey(mesh=grad.device_mesh, dims=dims, average=average, dtype=grad.dtype)
                bucket = self._open.get(key)
                if bucket is None:
                    bucket = _Bucket(key=key)
                    self._open[key] = bucket
                bucket.parameters.append(parameter)
                bucket.grads.append(grad)
                bucket.nbytes += grad.to_local().numel() * grad.element_size()
                if bucket.nbytes >= self._bucket_bytes:
                    self._launch(self._open.pop(key))
        if self._seen == len(self._names):
            # Every hooked gradient of this backward is in: launch the partly filled buckets now.
            self._launch_all()

    def _launch_all(self) -> None:
        for bucket in self._open.values():
            self._launch(bucket)
        self._open.clear()

    def _launch(self, bucket: _Bucket) -> None:
        flat = torch.cat([grad.to_local().reshape(-1) for grad in bucket.grads])
        dims = list(bucket.key.dims)
        first = dims.pop(0)
        work = dist.all_reduce(flat, group=bucket.key.mesh.get_group(first), async_op=True)
        self._in_flight.append(_Reduction(bucket=bucket, flat=flat, work=work, remaining_dims=dims))
        self._launched += 1

    def _complete(self, reduction: _Reduction) -> None:
        bucket = reduction.bucket
        mesh = bucket.key.mesh
        if reduction.work is not None:
            reduction.work.wait()
        for dim in reduction.remaining_dims:
            # Several pending dims: reduce over each in turn (sum over a product of groups).
            dist.all_reduce(reduction.flat, group=mesh.get_group(dim))
        if bucket.key.average:
            count = 1
            for dim in bucket.key.dims:
                count *= mesh.size(dim)
            reduction.flat.div_(count)
        offset = 0
        for parameter, grad in zip(bucket.parameters, bucket.grads, strict=True):
            local = grad.to_local()
            numel = local.numel()
            local.copy_(reduction.flat[offset : offset + numel].view_as(local))
            offset += numel
            placements: list[Placement] = [
                Replicate() if isinstance(p, Partial) else p for p in grad.placements
            ]
            parameter.grad = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=grad.shape, stride=grad.stride()
            )
