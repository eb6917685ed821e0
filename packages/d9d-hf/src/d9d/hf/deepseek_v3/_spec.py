"""The resolved description a DeepSeek-V3 model is built from (no Hugging Face field names left)."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.hf._decoder import DecoderSpec


@dataclass(kw_only=True, frozen=True)
class DeepseekV3LatentSpec:
    """Multi-head latent attention's widths (``MultiHeadLatentAttention``'s arguments).

    Attributes:
        q_lora_rank: Rank of the query compression; None for a plain ``q_proj``.
        kv_lora_rank: Rank of the key/value latent.
        qk_nope_head_dim: Per-head query/key channels without rotation.
        qk_rope_head_dim: Per-head rotated query/key channels (the key part shared by heads).
        v_head_dim: Per-head value size.
        softmax_scale: Score multiplier (DeepSeek's YaRN rule applied).
        attention_bias: Biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    attention_bias: bool


@dataclass(kw_only=True, frozen=True)
class DeepseekV3MoeSpec:
    """The sparse layers: sigmoid, group-limited routing with a selection bias, and shared experts.

    Attributes:
        top_k: Experts per token.
        intermediate_size: Hidden width of every routed expert.
        shared_intermediate_size: Hidden width of the shared expert (``n_shared_experts`` of them,
            fused as transformers does).
        num_groups: Expert groups (``n_group``).
        top_groups: Groups kept per token (``topk_group``).
        norm_topk_prob: Renormalize the chosen experts' weights to sum to one.
        routed_scaling_factor: Multiplier of the routed weights.
        first_k_dense_replace: Layers before this index are dense.
    """

    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    num_groups: int
    top_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int


@dataclass(kw_only=True, frozen=True)
class DeepseekV3Spec(DecoderSpec):
    """Every number a DeepSeek-V3 model needs: the core's ``DecoderSpec`` and DeepSeek-V3's own.

    ``head_dim`` is the padded width of the cached keys and values (the wider of the query/key
    and value head sizes), ``rotary_dim`` the rotated part; keys and values are per head
    (``num_kv_heads == num_heads``).

    Attributes:
        intermediate_size: Hidden width of the dense feed-forwards.
        latent: The attention's widths.
        moe: The sparse layers.
    """

    intermediate_size: int
    latent: DeepseekV3LatentSpec
    moe: DeepseekV3MoeSpec
