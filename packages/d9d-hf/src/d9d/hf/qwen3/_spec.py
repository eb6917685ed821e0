"""The resolved description a Qwen3 model is built from (no Hugging Face field names left)."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.hf._decoder import DecoderSpec
from d9d.kernels.layers import RopeScaling


@dataclass(kw_only=True, frozen=True)
class Qwen3MoeSpec:
    """The routed experts of the sparse layers (Qwen3-MoE has no shared expert).

    Attributes:
        num_experts: Routed experts per sparse layer.
        top_k: Experts per token.
        intermediate_size: Hidden width of every expert.
        norm_topk_prob: Renormalize the chosen experts' weights to sum to one.
        router_aux_loss_coef: Weight of the load-balancing loss (0 disables it).
        output_router_logits: Whether training adds the load-balancing loss at all
            (transformers adds it only when config.json's ``output_router_logits`` is true).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    router_aux_loss_coef: float
    output_router_logits: bool

    @property
    def load_balancing_coefficient(self) -> float:
        """The weight the objective gives the pooled load-balancing loss (0: not added)."""
        return self.router_aux_loss_coef if self.output_router_logits else 0.0


@dataclass(kw_only=True, frozen=True)
class Qwen3Spec:
    """Every number a Qwen3 (dense or MoE) model needs.

    Attributes:
        vocab_size: Vocabulary size.
        hidden_size: Model width.
        intermediate_size: Hidden width of the dense feed-forwards.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Per-head size.
        rms_norm_eps: Epsilon of every RMSNorm.
        rope_theta: Rotary base.
        rope_scaling: Rotary context extension, None for plain RoPE.
        attention_bias: Biases on q/k/v/o.
        sliding_windows: Per layer, the attention window (None: full attention).
        tie_word_embeddings: The LM head shares the embedding's weight.
        moe: The experts; None for a dense model.
        moe_layers: Per layer, whether its feed-forward is the MoE (else dense SwiGLU).
        pad_token_id: Padding token (sequence classification pools the last other token).
        num_labels: Classes of a sequence-classification head.
        initializer_range: Standard deviation of the initialization.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    attention_bias: bool
    sliding_windows: tuple[int | None, ...]
    tie_word_embeddings: bool
    moe: Qwen3MoeSpec | None
    moe_layers: tuple[bool, ...]
    pad_token_id: int | None
    num_labels: int
    initializer_range: float

    def decoder_spec(self) -> DecoderSpec:
        """The numbers the decoder core reads."""
        return DecoderSpec(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=self.pad_token_id,
            num_labels=self.num_labels,
            initializer_range=self.initializer_range,
            has_experts=self.moe is not None,
            num_experts=0 if self.moe is None else self.moe.num_experts,
            load_balancing_coefficient=0.0 if self.moe is None else self.moe.load_balancing_coefficient,
        )
