"""Mesh domains: the views of one world layout that different parts of a job need.

Vocabulary: a *mesh dim* is a named axis of a ``DeviceMesh``; a *domain* is one named view of the
world's ranks as a ``DeviceMesh``. Every domain is a reshape of the same world rank layout
``(pp, dp_replicate, dp_shard, cp_shard, cp_replicate, tp)`` in row-major order (tp innermost), so a
rank has consistent coordinates in all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from d9d.mesh._parameters import MeshParameters

MeshDomain = Literal["regular", "dense", "expert", "batch", "flat"]

REGULAR_DOMAIN: MeshDomain = "regular"
"""Every parallelism as its own mesh dim: ``pp, dp_replicate, dp_shard, cp_shard, cp_replicate, tp``."""
DENSE_DOMAIN: MeshDomain = "dense"
"""Dims ``pp, dp_replicate, dp_cp_shard, cp_replicate, tp`` for dense parameters.

FSDP shards over ``dp_cp_shard`` (data and context-parallel shard ranks together)."""
EXPERT_DOMAIN: MeshDomain = "expert"
"""Dims ``pp, ep_replicate, ep_shard`` for expert parameters: experts are sharded over ``ep_shard``."""
BATCH_DOMAIN: MeshDomain = "batch"
"""Dims ``pp, dp, cp, tp``: for data loading (shard over ``dp``) and loss maths."""
FLAT_DOMAIN: MeshDomain = "flat"
"""One dim ``world`` holding every rank."""

ALL_DOMAINS: tuple[MeshDomain, ...] = (REGULAR_DOMAIN, DENSE_DOMAIN, EXPERT_DOMAIN, BATCH_DOMAIN, FLAT_DOMAIN)


@dataclass(frozen=True, kw_only=True)
class DomainLayout:
    """Shape and dim names of one domain, and the world ranks at each mesh coordinate."""

    dim_names: tuple[str, ...]
    ranks: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.ranks.shape)


def domain_layout(domain: MeshDomain, parameters: MeshParameters) -> DomainLayout:
    """Computes the rank layout of ``domain`` for a job with ``parameters``.

    Args:
        domain: Which view of the world to compute.
        parameters: The job's parallelism degrees.

    Returns:
        The dim names and the world rank at every coordinate.
    """
    p = parameters
    world = torch.arange(p.world_size, dtype=torch.int64)
    match domain:
        case "regular":
            return DomainLayout(
                dim_names=("pp", "dp_replicate", "dp_shard", "cp_shard", "cp_replicate", "tp"),
                ranks=world.reshape(
                    p.pipeline_parallel,
                    p.data_parallel_replicate,
                    p.data_parallel_shard,
                    p.context_parallel_shard,
                    p.context_parallel_replicate,
                    p.tensor_parallel,
                ),
            )
        case "dense":
            return DomainLayout(
                dim_names=("pp", "dp_replicate", "dp_cp_shard", "cp_replicate", "tp"),
                ranks=world.reshape(
                    p.pipeline_parallel,
                    p.data_parallel_replicate,
                    p.data_parallel_shard * p.context_parallel_shard,
                    p.context_parallel_replicate,
                    p.tensor_parallel,
                ),
            )
        case "expert":
            return DomainLayout(
                dim_names=("pp", "ep_replicate", "ep_shard"),
                ranks=world.reshape(
                    p.pipeline_parallel, p.ranks_per_stage // p.expert_parallel, p.expert_parallel
                ),
            )
        case "batch":
            return DomainLayout(
                dim_names=("pp", "dp", "cp", "tp"),
                ranks=world.reshape(
                    p.pipeline_parallel, p.data_parallel, p.context_parallel, p.tensor_parallel
                ),
            )
        case "flat":
            return DomainLayout(dim_names=("world",), ranks=world)
