"""Sequence-parallel norms (and other per-token modules) that run on local tensors."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import ParallelStyle

from d9d.parallel._local_forward import LocalParameterSlot, install_local_forward
from d9d.parallel._mesh_dims import require_one_dim
from d9d.parallel._module_parameters import owned_parameters, require_parameters
from d9d.parallel._replicate import to_replicated_parameter


class SequenceParallelNorm(ParallelStyle):
    """Tensor-parallel style for a per-token module (a norm) fed this rank's sequence shard.

    Unlike torch's ``SequenceParallel``, forward runs on plain local tensors, so norms built on
    custom kernels work: the module's input and output are this rank's slice of the sequence
    (the local output of ``RowwiseParallel(output_layouts=Shard(1))`` or of a vocabulary-parallel
    embedding with ``sequence_parallel=True``, and the input of
    ``ColwiseParallel(input_layouts=Shard(1))``). Its parameters become ``Replicate()`` DTensors
    on the tp mesh; each rank's weight gradient covers only its tokens, so it is marked
    ``Partial("sum")`` and summed over the tp ranks (by ``GradientSynchronizer``, or by FSDP
    when the module is also sharded).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        purpose = f"SequenceParallelNorm on {type(module).__name__}"
        require_one_dim(device_mesh, purpose=purpose)
        require_parameters(module, purpose=purpose)
        slots: list[LocalParameterSlot] = []
        for owned in owned_parameters(module):
            if isinstance(owned.parameter, DTensor):
                raise ValueError(f"{purpose}: parameter {owned.qualified_name} is already a DTensor")
            setattr(owned.owner, owned.name, to_replicated_parameter(owned.parameter, device_mesh))
            slots.append(
                LocalParameterSlot(owner=owned.owner, name=owned.name, grad_placements=(Partial("sum"),))
            )
        install_local_forward(module, slots)
        return module
