"""What one decoder layer is made of, as general switches: the description a family gives the core."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NormLayout = Literal["pre", "post", "sandwich"]
"""Where a layer's norms sit around its two branches (attention, feed-forward):

- ``"pre"``: ``x + attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``;
- ``"post"``: no norm before a branch, each branch's output normalized:
  ``x + post_attention_layernorm(attn(x))`` then ``x + post_feedforward_layernorm(mlp(x))``;
- ``"sandwich"``: both, four norms: ``x + post_attention_layernorm(attn(input_layernorm(x)))``
  then ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``.

The module names are transformers' in each layout.
"""

QkNorm = Literal["none", "head", "all_heads"]
"""The attention's q/k norms: none, one per head (a ``head_dim``-wide weight), or one over the whole
projection of all heads (a weight per channel)."""

FeedForwardActivation = Literal["silu", "gelu_tanh"]
"""The gate's activation of the gated MLP: SiLU (SwiGLU) or the tanh-approximated GELU."""


@dataclass(frozen=True, kw_only=True)
class LayerRecipe:
    """One decoder layer's parts and switches, from which ``build_layer`` builds a ``DecoderLayer``.

    A family's config gives one per layer (``DecoderConfigBase.layer_recipe``): the widths from
    config.json and the switches its layers differ by; the defaults are the plain pre-norm layer
    (no biases, no q/k norms, full attention, SiLU-gated MLP).

    Attributes:
        hidden_size: The residual stream's width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (a divisor of ``num_heads``).
        head_dim: The per-head width.
        intermediate_size: The gated MLP's inner width.
        norm_eps: Every norm's epsilon, the q/k norms' too.
        init_std: The projections' initialization standard deviation.
        qkv_bias: Biases on the q/k/v projections.
        o_bias: A bias on the output projection (only together with ``qkv_bias``).
        qk_norm: The attention's q/k norms.
        sliding_window: The attention's window of past tokens (None: full attention).
        softmax_scale: The scores' scale (None: ``head_dim ** -0.5``).
        mlp_bias: Biases on the MLP's projections.
        activation: The MLP gate's activation.
        norm_layout: Where the norms sit (``NormLayout``).
        zero_centered_norms: Every norm of the layer, the q/k norms too, scales by ``1 + weight``.
        residual_multiplier: Each branch's output is multiplied by it as it joins the residual
            stream (1: unscaled).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    init_std: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: QkNorm = "none"
    sliding_window: int | None = None
    softmax_scale: float | None = None
    mlp_bias: bool = False
    activation: FeedForwardActivation = "silu"
    norm_layout: NormLayout = "pre"
    zero_centered_norms: bool = False
    residual_multiplier: float = 1.0

    def __post_init__(self) -> None:
        if self.o_bias and not self.qkv_bias:
            raise ValueError(
                "LayerRecipe(o_bias=True) needs qkv_bias=True: an o_proj bias alone is not built"
            )
