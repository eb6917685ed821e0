"""One DeepSeek-V3 decoder layer: pre-norm multi-head latent attention, then a dense or MoE feed-forward."""

from __future__ import annotations

from d9d.hf._decoder import DecoderLayer
from d9d.hf.deepseek_v3._spec import DeepseekV3Spec
from d9d.kernels.layers import (
    AttentionBackend,
    AttentionBackendName,
    GroupLimitedSelection,
    MoELayer,
    MultiHeadLatentAttention,
    RMSNorm,
    SwiGLU,
)

LATENT_NORM_EPS = 1e-6
"""Epsilon of the q/kv latent norms: transformers builds them with its RMSNorm's default, not
config.json's ``rms_norm_eps``."""


class DeepseekV3DecoderLayer(DecoderLayer):
    """DeepSeek-V3's layer: MLA, then a SwiGLU (first ``first_k_dense_replace`` layers) or the MoE.

    The MoE (``MoELayer``) routes by sigmoid scores with the group-limited top-k and the
    checkpoint's selection bias (``e_score_correction_bias``), scales the routed weights by
    ``routed_scaling_factor`` and adds the shared expert.

    Args:
        spec: The model description.
        index: This layer's global index (dense or sparse feed-forward).
        attention_backend: Passed to ``MultiHeadLatentAttention``.
    """

    def __init__(
        self,
        spec: DeepseekV3Spec,
        index: int,
        *,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        latent = spec.latent
        attention = MultiHeadLatentAttention(
            spec.hidden_size,
            spec.num_heads,
            q_lora_rank=latent.q_lora_rank,
            kv_lora_rank=latent.kv_lora_rank,
            qk_nope_head_dim=latent.qk_nope_head_dim,
            qk_rope_head_dim=latent.qk_rope_head_dim,
            v_head_dim=latent.v_head_dim,
            bias=latent.attention_bias,
            latent_norm_eps=LATENT_NORM_EPS,
            softmax_scale=latent.softmax_scale,
            rope_layout=spec.rope_layout,
            attention_backend=attention_backend,
            init_std=spec.initializer_range,
        )
        super().__init__(
            input_layernorm=RMSNorm(spec.hidden_size, spec.rms_norm_eps),
            self_attn=attention,
            post_attention_layernorm=RMSNorm(spec.hidden_size, spec.rms_norm_eps),
            mlp=_feed_forward(spec, index),
        )


def _feed_forward(spec: DeepseekV3Spec, index: int) -> SwiGLU | MoELayer:
    """Layer ``index``'s feed-forward: dense before ``first_k_dense_replace``, else the experts."""
    std = spec.initializer_range
    moe = spec.moe
    if index < moe.first_k_dense_replace:
        return SwiGLU(spec.hidden_size, spec.intermediate_size, init_std=std)
    return MoELayer(
        spec.hidden_size,
        spec.num_experts,
        moe.top_k,
        moe.intermediate_size,
        shared_expert_intermediate_size=moe.shared_intermediate_size,
        score_function="sigmoid",
        renormalize=moe.norm_topk_prob,
        expert_bias=True,  # e_score_correction_bias: the checkpoint's (DecoderSpec.checkpoint_expert_bias)
        router_selection=GroupLimitedSelection(num_groups=moe.num_groups, top_groups=moe.top_groups),
        routed_scaling_factor=moe.routed_scaling_factor,
        init_std=std,
    )
