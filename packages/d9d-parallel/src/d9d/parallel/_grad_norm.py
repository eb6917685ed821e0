"""Total gradient norm and clipping over any mix of placements and pipeline stages."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

# torch's multi-tensor multiply and norm (what its optimizers and clipping use) have no public
# name in torch 2.11.
_foreach_mul_ = cast(Callable[[list[torch.Tensor], torch.Tensor], None], torch.__dict__["_foreach_mul_"])
_foreach_norm = cast(Callable[..., tuple[torch.Tensor, ...]], torch.__dict__["_foreach_norm"])


def _local_gradients(
    parameters: Iterable[nn.Parameter],
) -> dict[tuple[DeviceMesh | None, tuple[int, ...]], list[torch.Tensor]]:
    groups: dict[tuple[DeviceMesh | None, tuple[int, ...]], list[torch.Tensor]] = {}
    for index, parameter in enumerate(parameters):
        grad = parameter.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(isinstance(p, Partial) for p in grad.placements):
                raise ValueError(
                    f"gradient of parameter #{index} (shape {tuple(grad.shape)}) is Partial "
                    f"{grad.placements} on mesh dims {grad.device_mesh.mesh_dim_names}: reduce it "
                    "first (GradientSynchronizer.finish()) before computing its norm"
                )
            # Every dim that is not Replicate holds distinct pieces (Shard, or torch's strided
            # shards of FSDP over TP, which are no Shard subclass): the sum runs over them.
            shard_dims = tuple(i for i, p in enumerate(grad.placements) if not isinstance(p, Replicate))
            key: tuple[DeviceMesh | None, tuple[int, ...]] = (grad.device_mesh, shard_dims)
            groups.setdefault(key, []).append(grad.to_local())
        else:
            groups.setdefault((None, ()), []).append(grad)
    return groups


# From this many elements a gradient's norm gets its own reduction kernel, smaller ones share
# torch's multi-tensor norm (whose launches cover a few hundred chunks of 64K elements each).
# On an H200 (benchmarks/gradient_norm.py), 3.7B bf16 gradients of six Qwen3-30B-A3B layers took
# 3.33 ms all multi-tensor, 2.16 ms split at 2**24 elements and 2.43 ms one kernel per tensor;
# Qwen3-0.6B's 310 tensors (only the embedding is that large) 1.47 and 1.43 ms.
_OWN_KERNEL_ELEMENTS = 1 << 24


def _sum_of_powers(
    tensors: list[torch.Tensor], norm_type: float, own_kernel_elements: int = _OWN_KERNEL_ELEMENTS
) -> torch.Tensor:
    """The sum of ``|x|^p`` over all elements of ``tensors`` (any float dtype), in float32."""
    large = [t for t in tensors if t.numel() >= own_kernel_elements]
    small = [t for t in tensors if t.numel() < own_kernel_elements]
    norms: list[torch.Tensor] = list(_foreach_norm(small, norm_type, dtype=torch.float32)) if small else []
    norms += [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in large]
    return (torch.stack(norms) ** norm_type).sum()


def _group_device(group: ProcessGroup) -> torch.device:
    # NCCL reduces device tensors only; gloo takes CPU tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class GradientClip:
    """A gradient norm and the factor that scales and clips the gradients, both on the device.

    Attributes:
        norm: The total norm of the scaled gradients before clipping (float32 scalar).
        factor: What every gradient is to be multiplied by (``grad_scale`` times the clipping
            coefficient, float32 scalar); None when that is exactly 1 (no scale, no clipping).
        gradients: The local gradients (shards of DTensor ones) the norm was taken over.
    """

    norm: torch.Tensor
    factor: torch.Tensor | None
    gradients: tuple[torch.Tensor, ...] = field(default=(), repr=False)

    def apply(self) -> None:
        """Multiplies the gradients by ``factor`` in place (nothing when it is None).

        One multi-tensor kernel per (device, dtype) and no host synchronization.
        """
        if self.factor is None:
            return
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in self.gradients:
            by_dtype.setdefault((grad.device, grad.dtype), []).append(grad)
        with torch.no_grad():
            for (device, dtype), grads in by_dtype.items():
                _foreach_mul_(grads, self.factor.to(device=device, dtype=dtype))


def clip_grad_norm(
    parameters: Iterable[nn.Parameter],
    max_norm: float | None,
    *,
    norm_type: float = 2.0,
    pp_group: ProcessGroup | None = None,
    grad_scale: float | torch.Tensor = 1.0,
    exclude_from_norm: Collection[nn.Parameter] = (),
) -> torch.Tensor:
    """Computes the norm of all gradients as one vector and scales them to at most ``max_norm``.

    Each gradient counts once however it is placed: local ``norm^p`` sums are reduced over the
    mesh dims a gradient is sharded on (any placement but ``Replicate``; not over ``Replicate``
    dims, whose ranks hold copies), and then over ``pp_group`` to add the pipeline stages.
    Plain-tensor gradients count as this rank's own. Call it after gradients are reduced
    (``Partial`` gradients are refused).

    Args:
        parameters: This rank's parameters (of its pipeline stages); gradients may be None.
        max_norm: Largest allowed total norm; None only computes the norm.
        norm_type: The p of the p-norm; ``math.inf`` for the max norm.
        pp_group: Group of the ranks holding the other pipeline stages (None: one stage).
        grad_scale: A factor the stored gradients still need (e.g. a loss-weight correction
            known only after backward): the norm is that of ``grad_scale * grad``, and the scale
            is applied in the same single multi-tensor multiplication as the clipping. A scalar
            tensor (on the gradients' device) is used without reading it on the host.
        exclude_from_norm: Parameters of ``parameters`` whose gradient duplicates one counted
            elsewhere (e.g. the last pipeline stage's copy of a tied embedding): left out of the
            norm, still scaled and clipped by the same factor as the others.

    Returns:
        The total norm (of the scaled gradients) before clipping, a float32 scalar tensor on the
        gradients' device.

    Raises:
        ValueError: If a gradient is still ``Partial`` or ``norm_type`` is not positive.
    """
    clip = gradient_clip(
        parameters,
        max_norm,
        norm_type=norm_type,
        pp_group=pp_group,
        grad_scale=grad_scale,
        exclude_from_norm=exclude_from_norm,
    )
    clip.apply()
    return clip.norm


def gradient_clip(
    parameters: Iterable[nn.Parameter],
    max_norm: float | None,
    *,
    norm_type: float = 2.0,
    pp_group: ProcessGroup | None = None,
    grad_scale: float | torch.Tensor = 1.0,
    exclude_from_norm: Collection[nn.Parameter] = (),
) -> GradientClip:
    """``clip_grad_norm`` without touching the gradients: the norm and the factor to apply.

    For an optimizer that multiplies each gradient by a factor as it reads it (d9d-kernels'
    ``StochasticAdamW.step_with_gradient_scale``): that saves ``GradientClip.apply``, a whole
    pass over the gradients. Arguments and errors as in ``clip_grad_norm``.
    """
    if norm_type <= 0:
        raise ValueError(f"norm_type must be > 0, got {norm_type}")
    is_max = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
    excluded = {id(p) for p in exclude_from_norm}
    parameters = list(parameters)
    groups = _local_gradients(p for p in parameters if id(p) not in excluded)
    duplicates = (
        [
            g
            for locals_ in _local_gradients(p for p in parameters if id(p) in excluded).values()
            for g in locals_
        ]
        if excluded
        else []
    )
    if not groups and not duplicates and pp_group is None:
        return GradientClip(torch.zeros((), dtype=torch.float32), None)
    gradients = (*(g for locals_ in groups.values() for g in locals_), *duplicates)
    # A stage without gradients still joins the pipeline group's reduction below (with zero).
    fallback = torch.device("cpu") if pp_group is None else _group_device(pp_group)
    device = next((g[0].device for g in [*groups.values(), duplicates] if g), fallback)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, shard_dims), locals_ in groups.items():
        if is_max:
            part = torch.stack([g.detach().abs().max().float() for g in locals_ if g.numel() > 0] or [total])
            value = part.max()
        else:
            value = _sum_of_powers([g.detach() for g in locals_], norm_type)
        if mesh is not None:
            for dim in shard_dims:
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, value) if is_max else total + value
    if pp_group is not None:
        dist.all_reduce(total, op=op, group=pp_group)
    if isinstance(grad_scale, torch.Tensor):
        factor = grad_scale.detach().to(device=device, dtype=torch.float32).reshape(())
    else:
        factor = torch.full((), grad_scale, dtype=torch.float32, device=device)
    norm = (total if is_max else total ** (1.0 / norm_type)) * factor
    if max_norm is None and not isinstance(grad_scale, torch.Tensor) and grad_scale == 1.0:
        return GradientClip(norm, None, gradients)
    if max_norm is not None:
        factor = factor * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return GradientClip(norm, factor, gradients)
