"""Makes the replicas of every parameter equal after initialization."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def synchronize_replicas(module: nn.Module) -> None:
    """Broadcasts each DTensor parameter over its ``Replicate`` mesh dims from coordinate 0.

    Parameters built on the meta device are initialized after ``parallelize_*``; if that
    initialization draws different random numbers on different ranks (DTensor random ops on CPU
    do after sharded draws), replicas would start apart and stay apart. Call this once after
    initializing (or loading) to make every replica equal to the first one. Shards are left as
    they are. Every rank holding the module must call it (it issues collectives per parameter).
    """
    for parameter in module.parameters():
        if not isinstance(parameter, DTensor):
            continue
        mesh = parameter.device_mesh
        local = parameter.to_local()
        for dim, placement in enumerate(parameter.placements):
            if not isinstance(placement, Replicate) or mesh.size(dim) == 1:
                continue
            group = mesh.get_group(dim)
            dist.broadcast(local, src=dist.get_global_rank(group, 0), group=group)
