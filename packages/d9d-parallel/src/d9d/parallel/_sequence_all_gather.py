"""Differentiable all-gather of a load-balanced sequence, restored to global order."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from d9d.parallel._load_balanced_positions import local_positions


class _AllGatherRows(torch.autograd.Function):
    """Gathers tensor dim 0 from every rank; backward sums the gradients and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.rows = tensor.shape[0]
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad_outputs[0].contiguous()
        group = cast(ProcessGroup, ctx.group)
        rows = cast(int, ctx.rows)
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty((rows, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        # gloo has no reduce-scatter: all-reduce and keep this rank's rows.
        dist.all_reduce(grad, group=group)
        start = cast(int, ctx.rank) * rows
        return grad[start : start + rows].clone(), None


def gather_sequence(local: torch.Tensor, *, mesh: DeviceMesh, seq_dim: int = 1) -> torch.Tensor:
    """All-gathers the cp ranks' load-balanced parts of a sequence into global order.

    Differentiable: each rank's part receives the sum of all ranks' gradients for its tokens.
    """
    cp = mesh.size()
    length = local.shape[seq_dim] * cp
    moved = local.movedim(seq_dim, 0)
    gathered = cast(torch.Tensor, _AllGatherRows.apply(moved, mesh.get_group()))
    positions = torch.cat([local_positions(length, cp, rank, device=local.device) for rank in range(cp)])
    # Selecting after moving the sequence back gives a tensor of the usual layout (attention
    # kernels take it as it is), not a view with the sequence outermost.
    return gathered.movedim(0, seq_dim).index_select(seq_dim, torch.argsort(positions))
