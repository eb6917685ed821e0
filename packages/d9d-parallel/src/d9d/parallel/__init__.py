"""d9d parallelism: replicate, FSDP/HSDP, TP, CP, EP, gradient sync and clipping."""

from d9d.parallel._fully_shard import hsdp_mesh, parallelize_fsdp, parallelize_hsdp
from d9d.parallel._grad_norm import clip_grad_norm
from d9d.parallel._gradient_synchronizer import GradientSynchronizer
from d9d.parallel._local_forward import LocalParameterSlot, install_local_forward
from d9d.parallel._reduction import GradientReduction
from d9d.parallel._replicate import parallelize_replicate

__all__ = [
    "GradientReduction",
    "GradientSynchronizer",
    "LocalParameterSlot",
    "clip_grad_norm",
    "hsdp_mesh",
    "install_local_forward",
    "parallelize_fsdp",
    "parallelize_hsdp",
    "parallelize_replicate",
]
