"""Name-table rows shared by families whose layer tensors keep transformers' names."""

from __future__ import annotations

from d9d.hf._decoder._family import TensorName


def same_names(*names: str) -> list[TensorName]:
    """Rows for tensors that d9d names exactly as transformers does."""
    return [TensorName(hf=name, d9d=name) for name in names]


def attention_names(*, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> list[TensorName]:
    """The pre-norms, q/k/v/o projections (and their biases) and optional per-head q/k norms."""
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if qkv_bias:
        names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if o_bias:
        names.append("self_attn.o_proj.bias")
    if qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return same_names(*names)


def dense_mlp_names(*, bias: bool = False) -> list[TensorName]:
    """The SwiGLU feed-forward's gate/up/down projections (and their biases)."""
    kinds = ("weight", "bias") if bias else ("weight",)
    return same_names(*(f"mlp.{p}.{kind}" for p in ("gate_proj", "up_proj", "down_proj") for kind in kinds))
