"""The numbers the decoder core builds, loads and parallelizes a model from (any family)."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.kernels import RopeLayout
from d9d.kernels.layers import RopeScaling


@dataclass(kw_only=True, frozen=True)
class DecoderSpec:
    """What the core needs of a family's config.json, resolved (no Hugging Face field names left).

    Attributes:
        vocab_size: Vocabulary size.
        hidden_size: Model width.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Per-head size of the cached keys and values (also the rotary dimension unless
            ``rotary_dim`` says otherwise).
        rms_norm_eps: Epsilon of the final RMSNorm.
        rope_theta: Rotary base.
        rope_scaling: Rotary context extension, None for plain RoPE.
        tie_word_embeddings: The LM head shares the embedding's weight.
        pad_token_id: Padding token: its embedding row gets no gradient (as transformers'
            ``nn.Embedding(padding_idx=...)``), and sequence classification pools the last other token.
        num_labels: Classes of a sequence-classification head.
        initializer_range: Standard deviation of the initialization.
        has_experts: Some layer's feed-forward is a mixture of experts (where FSDP wraps the
            stage, it does so per layer even on one data-parallel rank, so no unit holds every
            expert's gathered weights).
        num_experts: Routed experts per sparse layer (0 without any).
        load_balancing_coefficient: Weight of the load-balancing loss in the training objective
            (0: none). Sparse layers hand over their routing statistics, carried from stage to
            stage; the last stage adds this weight times the loss pooled over every layer, as
            transformers' ``load_balancing_loss_func`` pools the router logits of all layers.
        embedding_multiplier: Multiplies the token embeddings before the first layer (1: none).
        logits_multiplier: Multiplies the language-model head's logits (1: none).
        round_embedding_multiplier: Round ``embedding_multiplier`` to the embedding's dtype
            before multiplying (a bf16 model multiplies by the bf16 value, as Gemma's
            transformers code does), instead of multiplying at full precision.
        alternate_rope_theta: A second rotary base, plain RoPE without scaling, for the layers
            in ``alternate_rope_layers`` (None: every layer uses ``rope_theta`` and ``rope_scaling``).
        alternate_rope_layers: Global indices of the layers that take the alternate rotary tables.
        zero_centered_final_norm: The final norm's scale is ``1 + weight`` (weight initialized to
            zero), RMSNorm's ``zero_centered_weight``.
        rotary_dim: Width of the rotary tables when it is not ``head_dim`` (DeepSeek-V3's MLA
            rotates only ``qk_rope_head_dim`` channels); None: ``head_dim``.
        rope_layout: Layout of the rotary tables (``"interleaved"``: rotate pairs, DeepSeek-V3's
            ``rope_interleave``).
        checkpoint_expert_bias: The checkpoint holds the routers' selection biases (DeepSeek-V3's
            ``e_score_correction_bias``): they are loaded, exported and kept, not the job's zeros.
        attention_sinks: The layers attend with sinks (GPT-OSS): an auto-detected attention
            backend is one that takes them.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    pad_token_id: int | None
    num_labels: int
    initializer_range: float
    has_experts: bool = False
    num_experts: int = 0
    load_balancing_coefficient: float = 0.0
    embedding_multiplier: float = 1.0
    logits_multiplier: float = 1.0
    round_embedding_multiplier: bool = False
    alternate_rope_theta: float | None = None
    alternate_rope_layers: frozenset[int] = frozenset()
    zero_centered_final_norm: bool = False
    rotary_dim: int | None = None
    rope_layout: RopeLayout = "half"
    checkpoint_expert_bias: bool = False
    attention_sinks: bool = False

    @property
    def load_balancing(self) -> bool:
        """Whether the stages carry load-balancing statistics (a nonzero coefficient)."""
        return self.load_balancing_coefficient != 0.0
