"""d9d-kernels layers: attention, MoE, norms, rotary embeddings and heads for any PyTorch model.

Every layer builds on the meta device and has ``reset_parameters()``; tensor, context and expert
parallelism apply from outside through plain submodules and two Protocol-typed slots
(``GroupedQueryAttention.attention_backend`` and ``MoELayer.dispatcher``).
"""

from d9d.kernels.layers._attention_backend import AttentionBackend
from d9d.kernels.layers._attention_backend_selection import (
    ATTENTION_BACKEND_ENV_VAR,
    AttentionBackendName,
    build_attention_backend,
    detect_attention_backend,
    select_attention_backend,
)
from d9d.kernels.layers._attention_mask import build_attention_mask
from d9d.kernels.layers._attention_sinks import SinkAttentionBackend, sdpa_with_sinks
from d9d.kernels.layers._eager_attention import EagerAttentionBackend
from d9d.kernels.layers._expert_activation import (
    ClampedSwiGLU,
    ExpertActivation,
    PlainSwiGLU,
    apply_expert_activation,
    clamped_swiglu,
)
from d9d.kernels.layers._flash_attention import (
    FLASH_ATTENTION_2_EXTRA,
    FLASH_ATTENTION_4_EXTRA,
    AttentionBackendUnavailableError,
    FlashAttention2Backend,
    FlashAttention4Backend,
)
from d9d.kernels.layers._flex_attention import FlexAttentionBackend
from d9d.kernels.layers._grouped_experts import GroupedMatmul, GroupedSwiGLUExperts, SharedInputGroupedMatmul
from d9d.kernels.layers._grouped_query_attention import GroupedQueryAttention
from d9d.kernels.layers._heads import ClassificationHead, EmbeddingHead, LanguageModelHead
from d9d.kernels.layers._key_value_cache import (
    AttendingKeyValueCache,
    KeyValueCache,
    NormalizingKeyValueCache,
    attend_cached,
)
from d9d.kernels.layers._latent_attention import MultiHeadLatentAttention, latent_attention_softmax_scale
from d9d.kernels.layers._load_balancing import (
    load_balancing_loss,
    load_balancing_statistics,
    pooled_load_balancing_loss,
)
from d9d.kernels.layers._moe_layer import MoELayer
from d9d.kernels.layers._moe_router import (
    GroupLimitedSelection,
    RouterOutput,
    RouterScoreFunction,
    RouterSelection,
    TopKRouter,
    TopKSelection,
)
from d9d.kernels.layers._pooling import Pooling, check_pooling_mask, pool_hidden_states
from d9d.kernels.layers._positions import (
    DocumentOffsets,
    cu_seqlens_from_document_ids,
    document_ids_from_cu_seqlens,
    document_ids_from_position_ids,
    position_ids_from_document_ids,
)
from d9d.kernels.layers._rms_norm import RMSNorm
from d9d.kernels.layers._rope_scaling import (
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeScaling,
    NtkRopeScaling,
    RopeScaling,
    YarnRopeScaling,
    compute_rope_frequencies,
)
from d9d.kernels.layers._rotary_applicator import RotaryApplicator
from d9d.kernels.layers._rotary_embedding import RotaryEmbedding
from d9d.kernels.layers._sdpa_attention import SdpaAttentionBackend
from d9d.kernels.layers._swiglu_feed_forward import SwiGLU
from d9d.kernels.layers._token_dispatcher import LocalTokenDispatcher, TokenDispatcher
from d9d.kernels.layers._token_embedding import TokenEmbedding

__all__ = [
    "ATTENTION_BACKEND_ENV_VAR",
    "FLASH_ATTENTION_2_EXTRA",
    "FLASH_ATTENTION_4_EXTRA",
    "AttentionBackend",
    "AttentionBackendName",
    "AttentionBackendUnavailableError",
    "AttendingKeyValueCache",
    "ClampedSwiGLU",
    "ClassificationHead",
    "EagerAttentionBackend",
    "EmbeddingHead",
    "ExpertActivation",
    "FlashAttention2Backend",
    "FlashAttention4Backend",
    "GroupedQueryAttention",
    "GroupedMatmul",
    "GroupedSwiGLUExperts",
    "GroupLimitedSelection",
    "KeyValueCache",
    "LanguageModelHead",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "LocalTokenDispatcher",
    "LongRopeScaling",
    "MoELayer",
    "MultiHeadLatentAttention",
    "NormalizingKeyValueCache",
    "NtkRopeScaling",
    "PlainSwiGLU",
    "Pooling",
    "RMSNorm",
    "RopeScaling",
    "RotaryApplicator",
    "RotaryEmbedding",
    "RouterOutput",
    "RouterScoreFunction",
    "RouterSelection",
    "SdpaAttentionBackend",
    "FlexAttentionBackend",
    "SharedInputGroupedMatmul",
    "SinkAttentionBackend",
    "SwiGLU",
    "TokenDispatcher",
    "TokenEmbedding",
    "TopKRouter",
    "TopKSelection",
    "YarnRopeScaling",
    "apply_expert_activation",
    "attend_cached",
    "build_attention_backend",
    "build_attention_mask",
    "check_pooling_mask",
    "clamped_swiglu",
    "compute_rope_frequencies",
    "DocumentOffsets",
    "cu_seqlens_from_document_ids",
    "detect_attention_backend",
    "document_ids_from_cu_seqlens",
    "document_ids_from_position_ids",
    "latent_attention_softmax_scale",
    "load_balancing_loss",
    "load_balancing_statistics",
    "pool_hidden_states",
    "pooled_load_balancing_loss",
    "position_ids_from_document_ids",
    "sdpa_with_sinks",
    "select_attention_backend",
]
