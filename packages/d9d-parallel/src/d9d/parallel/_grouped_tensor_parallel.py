"""Tensor parallelism for grouped projections (per-expert weights stacked along tensor dim 0).

A grouped SwiGLU block holds ``gate_proj`` and ``up_proj`` of shape ``(groups, hidden, inner)``
and ``down_proj`` of shape ``(groups, inner, hidden)``. Sharding ``inner`` over the tp ranks
splits every group's projection the way Megatron splits a dense MLP: the input is copied to every
rank (its gradient all-reduced in backward), each rank computes its slice of the inner
activations, and the down projection's partial outputs are all-reduced in forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.hooks import RemovableHandle

from d9d.parallel._local_forward import LocalParameterSlot, install_local_forward
from d9d.parallel._mesh_dims import require_one_dim


class _CopyToRanks(torch.autograd.Function):
    """Identity in forward; all-reduces the gradient over the group in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad_outputs[0].contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """All-reduces (sums) in forward; identity in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = tensor.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_outputs[0], None


def _shard_parameter(module: nn.Module, name: str, mesh: DeviceMesh, dim: int) -> LocalParameterSlot:
    parameter = getattr(module, name, None)
    if not isinstance(parameter, nn.Parameter):
        raise ValueError(
            f"parallelize_grouped_tensor_parallel: {type(module).__name__} has no parameter '{name}'"
        )
    if parameter.ndim != 3:
        raise ValueError(
            f"parallelize_grouped_tensor_parallel: {type(module).__name__}.{name} has shape "
            f"{tuple(parameter.shape)}; grouped projections are (groups, in, out)"
        )
    size = mesh.size()
    if parameter.shape[dim] % size != 0:
        raise ValueError(
            f"parallelize_grouped_tensor_parallel: {type(module).__name__}.{name} has size "
            f"{parameter.shape[dim]} along tensor dim {dim}, not divisible by the {size} tp ranks"
        )
    sharded = nn.Parameter(
        distribute_tensor(parameter.data, mesh, [Shard(dim)]), requires_grad=parameter.requires_grad
    )
    module.register_parameter(name, sharded)
    # Each rank's local gradient is complete for its slice: no reduction is pending.
    return LocalParameterSlot(owner=module, name=name, grad_placements=(Shard(dim),))


def parallelize_grouped_tensor_parallel(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    column_parameters: Sequence[str] = ("gate_proj", "up_proj"),
    row_parameters: Sequence[str] = ("down_proj",),
) -> list[RemovableHandle]:
    """Shards a grouped projection block's inner dim over a 1-D tensor-parallel mesh.

    ``column_parameters`` (``(groups, hidden, inner)``) become ``Shard(2)`` DTensors and
    ``row_parameters`` (``(groups, inner, hidden)``) ``Shard(1)``. The module's forward then sees
    its local slices: its first argument (the tokens, the same on every tp rank) gets its gradient
    all-reduced in backward, and its output (partial sums of the down projection) is all-reduced
    in forward. Any extra forward arguments (e.g. tokens per group) pass through unchanged.

    Args:
        module: The grouped block, e.g. d9d-kernels' ``GroupedSwiGLUExperts``.
        mesh: A 1-D tensor-parallel mesh.
        column_parameters: Names of the ``(groups, hidden, inner)`` parameters.
        row_parameters: Names of the ``(groups, inner, hidden)`` parameters.

    Returns:
        The hook handles installed on ``module``.

    Raises:
        ValueError: If the mesh is not 1-D, a parameter is missing or not 3-D, or the inner size
            is not divisible by the tp degree; the message names the module and parameter.
    """
    require_one_dim(mesh, purpose="parallelize_grouped_tensor_parallel")
    slots = [_shard_parameter(module, name, mesh, 2) for name in column_parameters]
    slots += [_shard_parameter(module, name, mesh, 1) for name in row_parameters]
    group = mesh.get_group()

    def copy_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        tokens = cast(torch.Tensor, _CopyToRanks.apply(args[0], group))
        return (tokens, *args[1:])

    def sum_output(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, _SumOverRanks.apply(output, group))

    handles = install_local_forward(module, slots)
    handles.append(module.register_forward_pre_hook(copy_input))
    handles.append(module.register_forward_hook(sum_output))
    return handles
