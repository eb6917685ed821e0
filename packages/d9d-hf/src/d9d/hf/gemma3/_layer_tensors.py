"""Gemma 3's name table: every layer tensor keeps its transformers name."""

from __future__ import annotations

from d9d.hf._decoder import LayerTensor, attention_names, dense_mlp_names, same_names


def gemma3_layer_tensors(*, attention_bias: bool) -> list[LayerTensor]:
    """A layer's tensors: four norms, q/k/v/o with per-head q/k norms, the gated MLP."""
    return [
        *attention_names(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True),
        *same_names("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"),
        *dense_mlp_names(),
    ]
