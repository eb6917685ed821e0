"""Builds a ``DecoderLayer`` from a ``LayerRecipe``: the one place a layer's parts are put together."""

from __future__ import annotations

from collections.abc import Callable

from d9d.hf._decoder._decoder_layer import DecoderLayer
from d9d.hf._decoder._layer_recipe import LayerRecipe
from d9d.kernels.layers import (
    AttentionBackend,
    AttentionBackendName,
    GroupedQueryAttention,
    MoELayer,
    RMSNorm,
    SwiGLU,
)


def build_layer(
    recipe: LayerRecipe,
    *,
    attention_backend: AttentionBackend | AttentionBackendName | None,
    feed_forward: Callable[[], SwiGLU | MoELayer] | None = None,
) -> DecoderLayer:
    """The decoder layer ``recipe`` describes, its modules named as transformers names them.

    Args:
        recipe: The layer's widths and switches.
        attention_backend: Passed to ``GroupedQueryAttention``.
        feed_forward: Builds the layer's ``mlp`` in place of the recipe's gated MLP (a
            ``MoELayer`` on a sparse layer); called after the attention is built, so a seeded
            initialization draws the attention's weights first, as with the gated MLP.

    Returns:
        The layer: attention, the norms of ``recipe.norm_layout``, then the feed-forward.
    """
    attention = _attention(recipe, attention_backend)

    def norm() -> RMSNorm:
        return RMSNorm(recipe.hidden_size, recipe.norm_eps, zero_centered_weight=recipe.zero_centered_norms)

    mlp = feed_forward() if feed_forward is not None else _gated_mlp(recipe)
    match recipe.norm_layout:
        case "pre":
            before_attention, before_feed_forward, after_feed_forward = norm(), None, None
        case "post":
            before_attention, before_feed_forward, after_feed_forward = None, None, norm()
        case "sandwich":
            before_attention, before_feed_forward, after_feed_forward = norm(), norm(), norm()
    return DecoderLayer(
        input_layernorm=before_attention,
        self_attn=attention,
        post_attention_layernorm=norm(),
        mlp=mlp,
        pre_feedforward_layernorm=before_feed_forward,
        post_feedforward_layernorm=after_feed_forward,
        norm_layout=recipe.norm_layout,
        residual_multiplier=recipe.residual_multiplier,
    )


def _attention(
    recipe: LayerRecipe, attention_backend: AttentionBackend | AttentionBackendName | None
) -> GroupedQueryAttention:
    """The grouped-query attention of ``recipe``, its output projection without a bias unless asked."""
    attention = GroupedQueryAttention(
        recipe.hidden_size,
        recipe.num_heads,
        recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        qk_norm=recipe.qk_norm != "none",
        qk_norm_scope="all_heads" if recipe.qk_norm == "all_heads" else "head",
        qk_norm_zero_centered=recipe.zero_centered_norms,
        norm_eps=recipe.norm_eps,
        bias=recipe.qkv_bias,
        sliding_window=recipe.sliding_window,
        softmax_scale=recipe.softmax_scale,
        attention_backend=attention_backend,
        init_std=recipe.init_std,
    )
    if recipe.qkv_bias and not recipe.o_bias:
        # GroupedQueryAttention gives all four projections a bias; nn.Linear's forward and the
        # initialization both take a None bias.
        attention.o_proj.register_parameter("bias", None)
    return attention


def _gated_mlp(recipe: LayerRecipe) -> SwiGLU:
    """The gated MLP of ``recipe``."""
    return SwiGLU(
        recipe.hidden_size,
        recipe.intermediate_size,
        bias=recipe.mlp_bias,
        init_std=recipe.init_std,
        activation=recipe.activation,
    )
