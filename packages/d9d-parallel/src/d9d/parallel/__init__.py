"""d9d parallelism: replicate, FSDP/HSDP, TP, CP, EP, gradient sync and clipping."""

from d9d.parallel._activation_checkpointing import (
    CheckpointingPolicy,
    FullCheckpointing,
    SelectiveCheckpointing,
    checkpoint_modules,
)
from d9d.parallel._all_to_all import all_to_all
from d9d.parallel._block_attention import (
    BlockAttentionKernel,
    BlockResult,
    CpuFlashBlockAttention,
    CudnnBlockAttention,
    block_attention_kernel_for,
)
from d9d.parallel._compute_cast import cast_parameters_for_compute
from d9d.parallel._context_parallel_attention import (
    AttentionBackend,
    AttentionLayerLike,
    ContextParallelAttention,
    parallelize_context_parallel,
)
from d9d.parallel._context_parallel_sharding import (
    context_parallel_position_ids,
    context_parallel_shard,
    context_parallel_unshard,
)
from d9d.parallel._deep_ep_buffer import DeepEPBuffer, DeepEPBufferFactory, DeepEPBuffers
from d9d.parallel._deep_ep_dispatcher import DeepEPTokenDispatcher
from d9d.parallel._expert_parallel import MoELayerLike, TokenDispatcherKind, parallelize_expert_parallel
from d9d.parallel._float8 import (
    DEFAULT_FLOAT8_EXCLUDE,
    Float8BaseLinear,
    Float8Recipe,
    Float8Training,
    MissingFloat8Error,
    convert_to_float8,
    float8_linear_names,
    precompute_float8_scales,
)
from d9d.parallel._float8_experts import (
    Float8GroupedMatmul,
    GroupedExpertsLike,
    GroupedMatmul,
    SharedInputGroupedMatmul,
    convert_experts_to_float8,
)
from d9d.parallel._float8_rowwise_casts import quantize_rowwise
from d9d.parallel._float8_weight_casts import Float8WeightCasts, WeightCasts
from d9d.parallel._fsdp_prefetch import prefetch_fsdp_units
from d9d.parallel._fully_shard import hsdp_mesh, parallelize_fsdp, parallelize_hsdp
from d9d.parallel._grad_norm import GradientClip, clip_grad_norm, gradient_clip
from d9d.parallel._gradient_synchronizer import GradientSynchronizer
from d9d.parallel._grouped_tensor_parallel import parallelize_grouped_tensor_parallel
from d9d.parallel._local_forward import LocalParameterSlot, install_local_forward
from d9d.parallel._reduction import GradientReduction
from d9d.parallel._replicate import parallelize_replicate
from d9d.parallel._sequence_parallel_norm import SequenceParallelNorm
from d9d.parallel._synchronize_replicas import synchronize_replicas
from d9d.parallel._token_dispatcher import AllToAllTokenDispatcher, TokenDispatcher
from d9d.parallel._vocab_parallel_cross_entropy import vocab_parallel_cross_entropy
from d9d.parallel._vocab_parallel_embedding import VocabParallelEmbedding

__all__ = [
    "DEFAULT_FLOAT8_EXCLUDE",
    "AllToAllTokenDispatcher",
    "AttentionBackend",
    "AttentionLayerLike",
    "BlockAttentionKernel",
    "BlockResult",
    "CheckpointingPolicy",
    "ContextParallelAttention",
    "CpuFlashBlockAttention",
    "CudnnBlockAttention",
    "DeepEPBuffer",
    "DeepEPBufferFactory",
    "DeepEPBuffers",
    "DeepEPTokenDispatcher",
    "Float8BaseLinear",
    "Float8GroupedMatmul",
    "Float8Recipe",
    "Float8Training",
    "Float8WeightCasts",
    "FullCheckpointing",
    "GradientClip",
    "GradientReduction",
    "GradientSynchronizer",
    "GroupedExpertsLike",
    "GroupedMatmul",
    "SharedInputGroupedMatmul",
    "LocalParameterSlot",
    "MissingFloat8Error",
    "MoELayerLike",
    "SelectiveCheckpointing",
    "SequenceParallelNorm",
    "TokenDispatcher",
    "TokenDispatcherKind",
    "VocabParallelEmbedding",
    "WeightCasts",
    "all_to_all",
    "block_attention_kernel_for",
    "checkpoint_modules",
    "cast_parameters_for_compute",
    "clip_grad_norm",
    "gradient_clip",
    "context_parallel_position_ids",
    "context_parallel_shard",
    "context_parallel_unshard",
    "convert_experts_to_float8",
    "convert_to_float8",
    "float8_linear_names",
    "hsdp_mesh",
    "install_local_forward",
    "parallelize_context_parallel",
    "parallelize_expert_parallel",
    "parallelize_fsdp",
    "parallelize_grouped_tensor_parallel",
    "parallelize_hsdp",
    "prefetch_fsdp_units",
    "parallelize_replicate",
    "precompute_float8_scales",
    "quantize_rowwise",
    "synchronize_replicas",
    "vocab_parallel_cross_entropy",
]
