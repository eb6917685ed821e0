"""Phi-3's name table: the checkpoint's fused ``qkv_proj`` and ``gate_up_proj``, d9d's separate projections.

The fused tensors are split on load and joined on export by state mappers (``FusedTensor`` rows),
so d9d's layer is Llama's (separate q/k/v and gate/up) and splits under Megatron's plan.
"""

from __future__ import annotations

from d9d.hf._decoder import FusedTensor, LayerTensor, same_names


def phi3_layer_tensors(*, hidden_q: int, hidden_kv: int, intermediate_size: int) -> list[LayerTensor]:
    """A layer's tensors: norms, fused q/k/v (``hidden_q``, ``hidden_kv`` rows), o, fused gate/up, down."""
    qkv = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
    gate_up = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
    return [
        *same_names("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"),
        FusedTensor(hf="self_attn.qkv_proj.weight", d9d=qkv, sizes=(hidden_q, hidden_kv, hidden_kv)),
        FusedTensor(hf="mlp.gate_up_proj.weight", d9d=gate_up, sizes=(intermediate_size, intermediate_size)),
        *same_names("mlp.down_proj.weight"),
    ]
