"""Mistral's name table: every layer tensor keeps its transformers name."""

from __future__ import annotations

from d9d.hf._decoder import LayerTensor, attention_names, dense_mlp_names


def mistral_layer_tensors() -> list[LayerTensor]:
    """A layer's tensors: norms, q/k/v/o and the MLP, none with a bias."""
    return [*attention_names(qkv_bias=False, o_bias=False, qk_norm=False), *dense_mlp_names()]
