"""One GPT-OSS decoder layer: attention with sinks and biases, then biased experts with a clamped SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.hf._decoder import DecoderLayer
from d9d.kernels.layers import (
    AttentionBackend,
    AttentionBackendName,
    ClampedSwiGLU,
    GroupedQueryAttention,
    MoELayer,
    RMSNorm,
)


@dataclass(kw_only=True, frozen=True)
class GptOssLayerSpec:
    """The numbers one GPT-OSS layer is built from.

    Attributes:
        hidden_size: Model width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Per-head width.
        attention_bias: Biases on q/k/v/o.
        sliding_window: This layer's window (None: full attention).
        num_experts: Routed experts.
        top_k: Experts per token.
        intermediate_size: Every expert's hidden width.
        swiglu_alpha: The clamped SwiGLU's sigmoid gain.
        swiglu_limit: The clamped SwiGLU's clamp bound.
        load_balancing_coefficient: Weight of the pooled load-balancing loss (0: none).
        rms_norm_eps: The norms' epsilon.
        init_std: Initialization standard deviation.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    sliding_window: int | None
    num_experts: int
    top_k: int
    intermediate_size: int
    swiglu_alpha: float
    swiglu_limit: float
    load_balancing_coefficient: float
    rms_norm_eps: float
    init_std: float


class GptOssDecoderLayer(DecoderLayer):
    """GPT-OSS's layer: pre-norm attention with sinks, then pre-norm experts (every layer is sparse).

    The router is a linear with a bias, softmax over the chosen experts (``renormalize``); the
    experts have biases and GPT-OSS's ``ClampedSwiGLU``.

    Args:
        spec: The layer's numbers.
        attention_backend: Passed to ``GroupedQueryAttention`` (it must attend with sinks: eager
            or SDPA).
    """

    def __init__(
        self,
        spec: GptOssLayerSpec,
        *,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        attention = GroupedQueryAttention(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            head_dim=spec.head_dim,
            bias=spec.attention_bias,
            sliding_window=spec.sliding_window,
            sinks=True,
            attention_backend=attention_backend,
            init_std=spec.init_std,
        )
        experts = MoELayer(
            spec.hidden_size,
            spec.num_experts,
            spec.top_k,
            spec.intermediate_size,
            router_bias=True,
            expert_projection_bias=True,
            expert_activation=ClampedSwiGLU(alpha=spec.swiglu_alpha, limit=spec.swiglu_limit),
            renormalize=True,  # softmax over the chosen experts' logits
            load_balancing_loss_coefficient=spec.load_balancing_coefficient or None,
            collect_load_balancing_loss=True,  # pooled over layers and weighted like the loss (d9d.hf)
            init_std=spec.init_std,
        )
        super().__init__(
            input_layernorm=RMSNorm(spec.hidden_size, spec.rms_norm_eps),
            self_attn=attention,
            post_attention_layernorm=RMSNorm(spec.hidden_size, spec.rms_norm_eps),
            mlp=experts,
        )
