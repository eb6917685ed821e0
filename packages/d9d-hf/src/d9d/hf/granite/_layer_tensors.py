"""Granite's name table: every layer tensor keeps its transformers name."""

from __future__ import annotations

from d9d.hf._decoder import LayerTensor, attention_names, dense_mlp_names


def granite_layer_tensors(*, attention_bias: bool, mlp_bias: bool) -> list[LayerTensor]:
    """A layer's tensors: norms, q/k/v/o (biases with ``attention_bias``), the MLP (``mlp_bias``)."""
    return [
        *attention_names(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False),
        *dense_mlp_names(bias=mlp_bias),
    ]
