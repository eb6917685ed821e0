"""The resolved description a Qwen3 model is built from (no Hugging Face field names left)."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.hf._decoder import DecoderSpec


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
class Qwen3Spec(DecoderSpec):
    """Every number a Qwen3 (dense or MoE) model needs: the core's ``DecoderSpec`` and Qwen3's own.

    The core's fields (widths, heads, rotary, head and initialization) are ``DecoderSpec``'s;
    ``has_experts``, ``num_experts`` and ``load_balancing_coefficient`` are set from ``moe``.

    Attributes:
        intermediate_size: Hidden width of the dense feed-forwards.
        attention_bias: Biases on q/k/v/o.
        sliding_windows: Per layer, the attention window (None: full attention).
        moe: The experts; None for a dense model.
        moe_layers: Per layer, whether its feed-forward is the MoE (else dense SwiGLU).
    """

    intermediate_size: int
    attention_bias: bool
    sliding_windows: tuple[int | None, ...]
    moe: Qwen3MoeSpec | None
    moe_layers: tuple[bool, ...]
