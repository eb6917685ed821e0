"""d9d-mesh: device meshes, the distributed context, collectives, tree sharding and seeding."""

from d9d.mesh._collectives import (
    all_gather_object,
    all_gather_variable_shape,
    gather_object,
    gather_variable_shape,
)
from d9d.mesh._context import DEFAULT_TIMEOUT, DeviceType, DistributedContext
from d9d.mesh._domains import (
    ALL_DOMAINS,
    BATCH_DOMAIN,
    DENSE_DOMAIN,
    EXPERT_DOMAIN,
    FLAT_DOMAIN,
    REGULAR_DOMAIN,
    DomainLayout,
    MeshDomain,
    domain_layout,
)
from d9d.mesh._nccl_environment import NCCL_ENVIRONMENT_DEFAULTS, apply_nccl_defaults
from d9d.mesh._parameters import MeshParameters
from d9d.mesh._seeding import derived_seed, seed_everything
from d9d.mesh._tree_sharding import map_tree, shard_tree, shard_tree_at, tree_tensors, unshard_tree

__all__ = [
    "ALL_DOMAINS",
    "BATCH_DOMAIN",
    "DEFAULT_TIMEOUT",
    "DENSE_DOMAIN",
    "EXPERT_DOMAIN",
    "FLAT_DOMAIN",
    "NCCL_ENVIRONMENT_DEFAULTS",
    "REGULAR_DOMAIN",
    "DeviceType",
    "DistributedContext",
    "DomainLayout",
    "MeshDomain",
    "MeshParameters",
    "all_gather_object",
    "all_gather_variable_shape",
    "apply_nccl_defaults",
    "domain_layout",
    "gather_object",
    "gather_variable_shape",
    "map_tree",
    "derived_seed",
    "seed_everything",
    "shard_tree",
    "shard_tree_at",
    "tree_tensors",
    "unshard_tree",
]
