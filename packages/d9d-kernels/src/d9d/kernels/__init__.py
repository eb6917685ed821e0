"""d9d-kernels: fused Triton ops with PyTorch reference implementations, and layers built on them.

Every op dispatches automatically (Triton for CUDA tensors, PyTorch elsewhere) and takes a
``backend`` argument to force one; ``import d9d.kernels`` works without Triton or a GPU.
"""

from d9d.kernels._backend import KernelBackend
from d9d.kernels._few_rows_linear import (
    FewRowsLinearMode,
    few_rows_linear,
    few_rows_linear_group,
    few_rows_swiglu,
)
from d9d.kernels._grouped_mm import grouped_mm
from d9d.kernels._host_state import HostStateOffload, available_host_memory
from d9d.kernels._linear_cross_entropy import CrossEntropyReduction, linear_cross_entropy
from d9d.kernels._linear_cross_entropy_chunks import linear_cross_entropy_chunk_tokens
from d9d.kernels._moe import moe_permute, moe_unpermute
from d9d.kernels._paged_attention import paged_decode_attention
from d9d.kernels._qk_norm_rope import QKNormRope, qk_norm_rope
from d9d.kernels._rms_norm import add_rms_norm, rms_norm, rms_norm_add
from d9d.kernels._rope import RopeLayout, apply_rope
from d9d.kernels._shared_input_linear import shared_input_linear, swiglu_projection
from d9d.kernels._stochastic_adamw import StochasticAdamW
from d9d.kernels._stochastic_rounding import (
    adamw_step_stochastic_,
    adamw_step_stochastic_multi_,
    copy_stochastic_,
)
from d9d.kernels._swiglu import swiglu

__all__ = [
    "CrossEntropyReduction",
    "FewRowsLinearMode",
    "HostStateOffload",
    "KernelBackend",
    "QKNormRope",
    "RopeLayout",
    "StochasticAdamW",
    "adamw_step_stochastic_",
    "adamw_step_stochastic_multi_",
    "add_rms_norm",
    "apply_rope",
    "available_host_memory",
    "copy_stochastic_",
    "few_rows_linear",
    "few_rows_linear_group",
    "few_rows_swiglu",
    "grouped_mm",
    "linear_cross_entropy",
    "linear_cross_entropy_chunk_tokens",
    "moe_permute",
    "moe_unpermute",
    "paged_decode_attention",
    "qk_norm_rope",
    "rms_norm",
    "rms_norm_add",
    "shared_input_linear",
    "swiglu",
    "swiglu_projection",
]
