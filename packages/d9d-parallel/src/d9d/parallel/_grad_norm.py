"""Total gradient norm and clipping over any mix of placements and pipeline stages."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate


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


def clip_grad_norm(
    parameters: Iterable[nn.Parameter],
    max_norm: float | None,
    *,
    norm_type: float = 2.0,
    pp_group: ProcessGroup | None = None,
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

    Returns:
        The total norm before clipping, a float32 scalar tensor on the gradients' device.

    Raises:
        ValueError: If a gradient is still ``Partial`` or ``norm_type`` is not positive.
    """
    if norm_type <= 0:
        raise ValueError(f"norm_type must be > 0, got {norm_type}")
    is_max = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
    parameters = list(parameters)
    with_grads = [p for p in parameters if p.grad is not None]
    if pp_group is None and not any(isinstance(p.grad, DTensor) for p in with_grads):
        # Plain tensors on one stage: exactly torch's own clipping (multi-tensor kernels).
        if not with_grads:
            return torch.zeros((), dtype=torch.float32)
        grads = [p.grad for p in with_grads if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm)
        return norm
    groups = _local_gradients(parameters)
    device = next((g[0].device for g in groups.values() if g), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, shard_dims), locals_ in groups.items():
        if is_max:
            part = torch.stack([g.detach().abs().max().float() for g in locals_ if g.numel() > 0] or [total])
            value = part.max()
        elif all(g.dtype == torch.float32 for g in locals_):
            # torch's multi-tensor norm: one kernel launch for the whole group
            value = torch.nn.utils.get_total_norm([g.detach() for g in locals_], norm_type) ** norm_type
        else:
            value = torch.stack(
                [torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in locals_]
            ).sum()
        if mesh is not None:
            for dim in shard_dims:
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, value) if is_max else total + value
    if pp_group is not None:
        dist.all_reduce(total, op=op, group=pp_group)
    norm = total if is_max else total ** (1.0 / norm_type)
    if max_norm is not None:
        plain = [p for p in parameters if p.grad is not None and not isinstance(p.grad, DTensor)]
        if plain:
            # the same coefficient, max_norm / (norm + 1e-6) capped at 1, in one multi-tensor op
            torch.nn.utils.clip_grads_with_norm_(plain, max_norm, norm)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for key, locals_ in groups.items():
            if key[0] is None:
                continue
            for grad in locals_:
                grad.mul_(coefficient.to(grad.dtype))
    return norm
