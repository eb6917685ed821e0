"""FSDP and HSDP on top of torch's ``fully_shard``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from d9d.parallel._mesh_dims import require_one_dim, shard_dim_name
from d9d.parallel._module_parameters import require_parameters
from d9d.parallel._reduction import GradientReduction


def _shard(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    gradient_reduction: GradientReduction,
    ignored_params: Iterable[nn.Parameter],
) -> FSDPModule:
    ignored = set(ignored_params)
    sharded = fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        ignored_params=ignored or None,
    )
    match gradient_reduction:
        case "mean":
            pass
        case "sum":
            sharded.set_gradient_divide_factor(1.0)
    return sharded


def _nothing_to_shard(
    mesh: DeviceMesh, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> bool:
    # One rank and no dtype policy: fully_shard would only add a gather and a reduce per step.
    return mesh.size() == 1 and param_dtype is None and reduce_dtype is None


def parallelize_fsdp(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    gradient_reduction: GradientReduction = "mean",
    ignored_params: Iterable[nn.Parameter] = (),
) -> nn.Module | FSDPModule:
    """Shards ``module``'s parameters over a 1-D mesh with torch's ``fully_shard`` (FSDP2).

    Parameters not yet managed by an inner ``fully_shard`` call become DTensors placed
    ``Shard(0)`` on the mesh (on top of any tensor-parallel placement they already have: apply
    tensor parallelism first). Forward all-gathers them, backward reduce-scatters the gradients.
    Call it on each block first and then on the root, so that blocks gather one at a time.

    Args:
        module: The module to shard, in place.
        mesh: A 1-D mesh whose ranks share the shards.
        reshard_after_forward: Free gathered parameters after forward (gather them again in
            backward) to save memory.
        param_dtype: Dtype the gathered parameters and the forward compute use (None: unchanged).
        reduce_dtype: Dtype of the gradient reduce-scatter (None: the gradient's).
        gradient_reduction: Average (default, as torch's FSDP) or sum gradients over the ranks.
        ignored_params: Parameters FSDP must leave alone, e.g. experts placed by
            ``parallelize_expert_parallel`` on another mesh (``GradientSynchronizer`` reduces
            their gradients instead).

    Returns:
        The same module, now also an ``FSDPModule``; on a single-rank mesh with no dtype policy
        the module is returned unchanged (plain parameters: nothing to shard, no per-step
        gathers), so the same provider code runs fast in one process.

    Raises:
        ValueError: If the mesh is not 1-D, or the module has no parameters.
    """
    purpose = "parallelize_fsdp"
    require_one_dim(mesh, purpose=purpose)
    require_parameters(module, purpose=purpose)
    if _nothing_to_shard(mesh, param_dtype, reduce_dtype):
        return module
    return _shard(
        module,
        mesh,
        reshard_after_forward=reshard_after_forward,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        gradient_reduction=gradient_reduction,
        ignored_params=ignored_params,
    )


def hsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Folds a mesh with several replicate dims and one shard dim into ``fully_shard``'s 2-D form.

    The shard dim is the one whose name ends in ``"shard"``; every other dim is a replicate dim.
    The result has dims ``(replicate, <shard dim>)``, the replicate dim named by joining the
    replicate dim names with ``"_"``. Existing process groups are reused where a single
    replicate dim has more than one rank; when several do, a group for their combination is
    created among this rank's replicas only (so ranks of other slices need not take part).
    Build it once and pass it to every ``parallelize_hsdp`` call of a job.

    Args:
        mesh: A mesh with exactly one dim named ``*shard``.

    Returns:
        A 2-D mesh, or ``mesh`` itself when it is 1-D or already ``(replicate, shard)``.

    Raises:
        ValueError: If the mesh has unnamed dims or not exactly one ``*shard`` dim.
    """
    purpose = "parallelize_hsdp"
    shard = shard_dim_name(mesh, purpose=purpose)
    names = tuple(mesh.mesh_dim_names or ())
    replicate = [name for name in names if name != shard]
    if not replicate or names == (replicate[0], shard):
        return mesh
    shard_index = names.index(shard)
    order = [names.index(name) for name in replicate] + [shard_index]
    ranks = mesh.mesh.permute(order).reshape(-1, mesh.size(shard_index))
    wide = [name for name in replicate if mesh.size(names.index(name)) > 1]
    if len(wide) <= 1:
        replicate_group = mesh.get_group(wide[0] if wide else replicate[0])
    else:
        coordinate = mesh.get_local_rank(shard)
        members = [int(rank) for rank in cast(list[int], ranks[:, coordinate].tolist())]
        group = dist.new_group(members, use_local_synchronization=True)
        if not isinstance(group, ProcessGroup):
            raise RuntimeError(f"rank {dist.get_rank()} could not join its replicate group {members}")
        replicate_group = group
    return DeviceMesh.from_group(
        [replicate_group, mesh.get_group(shard)],
        mesh.device_type,
        mesh=ranks,
        mesh_dim_names=("_".join(replicate), shard),
    )


def parallelize_hsdp(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    gradient_reduction: GradientReduction = "mean",
    ignored_params: Iterable[nn.Parameter] = (),
) -> nn.Module | FSDPModule:
    """Hybrid sharding: shards over the mesh's ``*shard`` dim, replicates over all other dims.

    ``parallelize_hsdp(model, mesh=mesh["dp_replicate", "dp_cp_shard", "cp_replicate"])`` on
    d9d's dense mesh shards over ``dp_cp_shard`` and replicates over ``dp_replicate`` and
    ``cp_replicate`` together. Parameters become DTensors placed ``(Replicate(), Shard(0))`` on
    the 2-D mesh from ``hsdp_mesh``; gradients are reduce-scattered over the shard dim and
    all-reduced over the replicas.

    Args:
        module: The module to shard, in place.
        mesh: A mesh with exactly one dim named ``*shard`` (any other dims are replicas), or the
            2-D mesh ``hsdp_mesh`` returned (pass that when calling this many times).
        reshard_after_forward: As in ``parallelize_fsdp``.
        param_dtype: As in ``parallelize_fsdp``.
        reduce_dtype: As in ``parallelize_fsdp``.
        gradient_reduction: Average (default) or sum gradients over all the mesh's ranks.
        ignored_params: As in ``parallelize_fsdp``.

    Returns:
        The same module, now also an ``FSDPModule``; unchanged on a single-rank mesh with no
        dtype policy (as ``parallelize_fsdp``).

    Raises:
        ValueError: If the mesh lacks a single ``*shard`` dim, or the module has no parameters.
    """
    require_parameters(module, purpose="parallelize_hsdp")
    shard_dim_name(mesh, purpose="parallelize_hsdp")
    if _nothing_to_shard(mesh, param_dtype, reduce_dtype):
        return module
    return _shard(
        module,
        hsdp_mesh(mesh),
        reshard_after_forward=reshard_after_forward,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        gradient_reduction=gradient_reduction,
        ignored_params=ignored_params,
    )
