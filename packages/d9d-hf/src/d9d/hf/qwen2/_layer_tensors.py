"""Qwen2's name table: every layer tensor keeps its transformers name."""

from __future__ import annotations

from d9d.hf._decoder import LayerTensor, attention_names, dense_mlp_names


def qwen2_layer_tensors() -> list[LayerTensor]:
    """A layer's tensors: norms, q/k/v with biases, o without, the SwiGLU MLP."""
    return [*attention_names(qkv_bias=True, o_bias=False, qk_norm=False), *dense_mlp_names()]
