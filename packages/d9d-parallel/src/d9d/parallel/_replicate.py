"""Data parallelism by replication: DTensor parameters, plain-tensor forward."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils.hooks import RemovableHandle

from d9d.parallel._local_forward import LocalParameterSlot, install_local_forward
from d9d.parallel._module_parameters import owned_parameters, require_parameters
from d9d.parallel._reduction import GradientReduction, partial_for


def to_replicated_parameter(parameter: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """Returns ``parameter`` as a DTensor replicated on every dim of ``mesh``.

    Real tensors are broadcast from the first rank of each mesh dim, so replicas start equal;
    meta tensors are wrapped as they are (materialize and initialize them afterwards).
    """
    placements: list[Placement] = [Replicate()] * mesh.ndim
    data = parameter.detach()
    if data.is_meta:
        distributed = DTensor.from_local(data, mesh, placements, run_check=False)
    else:
        distributed = distribute_tensor(data, mesh, placements)
    return nn.Parameter(distributed, requires_grad=parameter.requires_grad)


def parallelize_replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    gradient_reduction: GradientReduction = "mean",
) -> list[RemovableHandle]:
    """Replicates ``module``'s parameters over every dim of ``mesh`` (data parallelism).

    Every plain-tensor parameter becomes a ``Replicate()`` DTensor on each mesh dim; parameters
    that are DTensors already (tensor-parallel, say) are left as they are. During ``forward``
    the module sees the local tensors, so any PyTorch code runs unchanged. The gradient each rank
    computes is marked ``Partial`` over the mesh (``"avg"`` for ``gradient_reduction="mean"``,
    ``"sum"`` for ``"sum"``); ``GradientSynchronizer`` all-reduces it, after which the gradient is
    ``Replicate()`` like its parameter.

    Args:
        module: The module to replicate, in place.
        mesh: The data-parallel mesh; every dim is a replica dim. Any dim names.
        gradient_reduction: Average (default, as DDP) or sum gradients over the mesh.

    Returns:
        Handles of the forward hooks that swap in local tensors.

    Raises:
        ValueError: If ``module`` has no parameters, or none that is not already a DTensor.
    """
    purpose = "parallelize_replicate"
    require_parameters(module, purpose=purpose)
    grad_placements = (partial_for(gradient_reduction),) * mesh.ndim
    converted: dict[int, nn.Parameter] = {}
    slots: list[LocalParameterSlot] = []
    for owned in owned_parameters(module):
        if isinstance(owned.parameter, DTensor):
            continue
        replicated = converted.get(id(owned.parameter))
        if replicated is None:
            replicated = to_replicated_parameter(owned.parameter, mesh)
            converted[id(owned.parameter)] = replicated
        setattr(owned.owner, owned.name, replicated)
        slots.append(LocalParameterSlot(owner=owned.owner, name=owned.name, grad_placements=grad_placements))
    if not slots:
        raise ValueError(
            f"{purpose}: every parameter of module {type(module).__name__} is already a DTensor; "
            "nothing to replicate"
        )
    return install_local_forward(module, slots)
