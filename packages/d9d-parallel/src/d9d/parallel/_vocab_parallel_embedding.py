"""Vocabulary-parallel embedding for any module that looks token ids up in ``weight``."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from d9d.parallel._local_forward import LocalParameterSlot, install_local_forward
from d9d.parallel._mesh_dims import require_one_dim


class VocabParallelEmbedding(ParallelStyle):
    """Shards an embedding's ``weight`` (vocab, hidden) over the vocabulary on the tp mesh.

    Works for any module whose forward takes token ids as its first argument and looks them up
    in ``self.weight`` (``nn.Embedding``, d9d's token embedding, an embedding with scaling).
    Each rank looks up the ids of its vocabulary slice (others are zeroed) and the partial
    results are summed across tp ranks: all-reduced into a replicated output, or, with
    ``sequence_parallel=True``, reduce-scattered into this rank's shard of the sequence
    (tensor dim 1). The output is a plain tensor; the gradient of ``weight`` stays ``Shard(0)``.
    """

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        """Args:
        sequence_parallel: Return this rank's sequence shard (dim 1) instead of the full output.
        """
        super().__init__()
        self._sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        purpose = f"VocabParallelEmbedding on {type(module).__name__}"
        require_one_dim(device_mesh, purpose=purpose)
        weight = module.get_parameter("weight") if hasattr(module, "weight") else None
        if weight is None or weight.ndim != 2:
            raise ValueError(f"{purpose}: the module needs a 2-D parameter 'weight' (vocab, hidden)")
        vocab = weight.shape[0]
        tp = device_mesh.size()
        if vocab % tp != 0:
            raise ValueError(f"{purpose}: vocabulary size {vocab} is not divisible by the tp degree {tp}")
        data = weight.detach()
        placements: list[Placement] = [Shard(0)]
        sharded = (
            DTensor.from_local(
                data.chunk(tp)[device_mesh.get_local_rank()], device_mesh, placements, run_check=False
            )
            if data.is_meta
            else distribute_tensor(data, device_mesh, placements)
        )
        module.register_parameter("weight", nn.Parameter(sharded, requires_grad=weight.requires_grad))
        rows = vocab // tp
        start = device_mesh.get_local_rank() * rows
        masks: list[torch.Tensor] = []
        output_placement: Placement = Shard(1) if self._sequence_parallel else Replicate()

        def mask_ids(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            ids = cast(torch.Tensor, args[0])
            outside = (ids < start) | (ids >= start + rows)
            masks.append(outside)
            return (torch.where(outside, 0, ids - start), *args[1:])

        def sum_partials(_module: nn.Module, _args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            outside = masks.pop()
            local = output.masked_fill(outside.unsqueeze(-1), 0.0)
            partial = DTensor.from_local(local, device_mesh, [Partial()], run_check=False)
            return partial.redistribute(device_mesh, [output_placement]).to_local()

        install_local_forward(
            module, [LocalParameterSlot(owner=module, name="weight", grad_placements=(Shard(0),))]
        )
        # Registered after the local-forward hooks: ids are shifted before, sums taken after.
        module.register_forward_pre_hook(mask_ids)
        module.register_forward_hook(sum_partials)
        return module
