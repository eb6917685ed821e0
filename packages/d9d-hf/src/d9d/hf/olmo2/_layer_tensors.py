"""OLMo 2's name table: every layer tensor keeps its transformers name."""

from __future__ import annotations

from d9d.hf._decoder import LayerTensor, dense_mlp_names, same_names


def olmo2_layer_tensors(*, attention_bias: bool) -> list[LayerTensor]:
    """A layer's tensors: q/k/v/o (biases with ``attention_bias``), q/k norms, two post-norms, the MLP."""
    names = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if attention_bias:
        names += [f"self_attn.{p}_proj.bias" for p in "qkvo"]
    names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names += ["post_attention_layernorm.weight", "post_feedforward_layernorm.weight"]
    return [*same_names(*names), *dense_mlp_names()]
