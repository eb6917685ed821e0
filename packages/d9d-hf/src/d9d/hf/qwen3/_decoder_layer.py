"""One Qwen3 decoder layer: pre-norm attention with q/k norms, then a dense or MoE feed-forward."""

from __future__ import annotations

from d9d.hf._decoder import DecoderLayer
from d9d.hf.qwen3._spec import Qwen3Spec
from d9d.kernels.layers import (
    AttentionBackend,
    AttentionBackendName,
    GroupedQueryAttention,
    MoELayer,
    RMSNorm,
    SwiGLU,
)


class Qwen3DecoderLayer(DecoderLayer):
    """Qwen3's layer: attention with per-head q/k norms, then a dense or MoE feed-forward.

    ``mlp`` is a ``SwiGLU`` on dense layers and a ``MoELayer`` (softmax top-k router, no shared
    expert) on the sparse layers of Qwen3-MoE.

    Args:
        spec: The model description.
        index: This layer's global index (selects its window and dense/sparse feed-forward).
        attention_backend: Passed to ``GroupedQueryAttention``.
    """

    def __init__(
        self,
        spec: Qwen3Spec,
        index: int,
        *,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        std = spec.initializer_range
        attention = GroupedQueryAttention(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            head_dim=spec.head_dim,
            qk_norm=True,
            norm_eps=spec.rms_norm_eps,
            bias=spec.attention_bias,
            sliding_window=spec.sliding_windows[index],
            attention_backend=attention_backend,
            init_std=std,
        )
        super().__init__(
            input_layernorm=RMSNorm(spec.hidden_size, spec.rms_norm_eps),
            self_attn=attention,
            post_attention_layernorm=RMSNorm(spec.hidden_size, spec.rms_norm_eps),
            mlp=_feed_forward(spec, index),
        )


def _feed_forward(spec: Qwen3Spec, index: int) -> SwiGLU | MoELayer:
    """Layer ``index``'s feed-forward: the experts on a sparse layer, else a dense SwiGLU."""
    std = spec.initializer_range
    if spec.moe is None or not spec.moe_layers[index]:
        return SwiGLU(spec.hidden_size, spec.intermediate_size, init_std=std)
    moe = spec.moe
    return MoELayer(
        spec.hidden_size,
        moe.num_experts,
        moe.top_k,
        moe.intermediate_size,
        renormalize=moe.norm_topk_prob,
        load_balancing_loss_coefficient=moe.load_balancing_coefficient or None,
        collect_load_balancing_loss=True,  # pooled over layers and weighted like the loss (d9d.hf)
        init_std=std,
    )
