"""Qwen3's name table: each decoder-layer tensor with its Hugging Face name.

Names are transformers' except the router (``mlp.gate.weight`` / ``mlp.router.weight``) and the
experts: transformers stores ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert, d9d one
stacked tensor per projection.
"""

from __future__ import annotations

from d9d.hf._decoder import LayerTensor, StackedExperts, TensorName, attention_names, dense_mlp_names
from d9d.hf.qwen3._spec import Qwen3Spec


def qwen3_layer_tensors(spec: Qwen3Spec, index: int) -> list[LayerTensor]:
    """Layer ``index``'s tensors: attention with q/k norms (biases on q/k/v/o), dense or MoE."""
    rows: list[LayerTensor] = [
        *attention_names(qkv_bias=spec.attention_bias, o_bias=spec.attention_bias, qk_norm=True)
    ]
    if spec.moe is None or not spec.moe_layers[index]:
        return rows + dense_mlp_names()
    rows.append(TensorName(hf="mlp.gate.weight", d9d="mlp.router.weight"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        experts = tuple(f"mlp.experts.{e}.{proj}.weight" for e in range(spec.moe.num_experts))
        rows.append(StackedExperts(hf=experts, d9d=f"mlp.experts.{proj}"))
    return rows
