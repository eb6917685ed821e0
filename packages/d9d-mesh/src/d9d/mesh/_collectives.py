"""Collectives that torch.distributed lacks: gathers of tensors whose shapes differ per rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _gather_shapes(tensor: torch.Tensor, group: ProcessGroup | None) -> list[torch.Size]:
    world = dist.get_world_size(group)
    ndims = [torch.zeros(1, dtype=torch.int64, device=tensor.device) for _ in range(world)]
    dist.all_gather(ndims, torch.tensor([tensor.ndim], dtype=torch.int64, device=tensor.device), group=group)
    ndim_values = {int(n.item()) for n in ndims}
    if len(ndim_values) != 1:
        raise ValueError(
            f"variable-shape gather needs the same number of tensor dims on every rank, got "
            f"{[int(n.item()) for n in ndims]} (rank {dist.get_rank()} has {tensor.ndim})"
        )
    shape = torch.tensor(list(tensor.shape), dtype=torch.int64, device=tensor.device)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    return [torch.Size(int(v) for v in s) for s in shapes]


def _padded_flat(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    flat = torch.zeros(numel, dtype=tensor.dtype, device=tensor.device)
    flat[: tensor.numel()] = tensor.reshape(-1)
    return flat


def all_gather_variable_shape(tensor: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """All-gathers tensors whose shapes may differ between ranks.

    Args:
        tensor: This rank's tensor; every rank must pass the same dtype and number of tensor dims.
        group: Process group to gather over (the default group when None).

    Returns:
        One tensor per rank of the group, in group-rank order, each with its original shape.
    """
    shapes = _gather_shapes(tensor, group)
    max_numel = max(s.numel() for s in shapes)
    buffers = [torch.empty(max_numel, dtype=tensor.dtype, device=tensor.device) for _ in shapes]
    dist.all_gather(buffers, _padded_flat(tensor, max_numel), group=group)
    return [buf[: s.numel()].reshape(s) for buf, s in zip(buffers, shapes, strict=True)]


def gather_variable_shape(
    tensor: torch.Tensor, *, dst: int = 0, group: ProcessGroup | None = None
) -> list[torch.Tensor] | None:
    """Gathers tensors whose shapes may differ between ranks onto one rank.

    Args:
        tensor: This rank's tensor; every rank must pass the same dtype and number of tensor dims.
        dst: Global rank that receives the tensors.
        group: Process group to gather over (the default group when None).

    Returns:
        On ``dst``, one tensor per rank of the group in group-rank order; elsewhere None.
    """
    shapes = _gather_shapes(tensor, group)
    max_numel = max(s.numel() for s in shapes)
    is_dst = dist.get_rank() == dst
    buffers = (
        [torch.empty(max_numel, dtype=tensor.dtype, device=tensor.device) for _ in shapes] if is_dst else None
    )
    dist.gather(_padded_flat(tensor, max_numel), buffers, dst=dst, group=group)
    if buffers is None:
        return None
    return [buf[: s.numel()].reshape(s) for buf, s in zip(buffers, shapes, strict=True)]


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """All-gathers a picklable object from every rank of ``group``, in group-rank order."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, *, dst: int = 0, group: ProcessGroup | None = None) -> list[Any] | None:
    """Gathers a picklable object onto global rank ``dst``; returns None on other ranks."""
    is_dst = dist.get_rank() == dst
    out: list[Any] | None = [None] * dist.get_world_size(group) if is_dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out
