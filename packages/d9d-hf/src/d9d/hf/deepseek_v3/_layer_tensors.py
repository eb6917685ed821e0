"""DeepSeek-V3's name table: each decoder-layer tensor with its Hugging Face name.

Names are transformers' except the router (``mlp.gate.weight`` / ``mlp.router.weight``, its
``e_score_correction_bias`` / ``mlp.router.expert_bias``), the shared expert (``shared_experts``
/ ``shared_expert``) and the experts: transformers stores ``mlp.experts.{e}.{gate,up,down}_proj.weight``
per expert, d9d one stacked tensor per projection.
"""

from __future__ import annotations

from d9d.hf._decoder import LayerTensor, StackedExperts, TensorName, dense_mlp_names, same_names
from d9d.hf.deepseek_v3._spec import DeepseekV3Spec

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _attention_names(spec: DeepseekV3Spec) -> list[TensorName]:
    latent = spec.latent
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if latent.q_lora_rank is None:
        names.append("self_attn.q_proj.weight")
    else:
        names += ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"]
    names += [
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
    ]
    if latent.attention_bias:
        names += ["self_attn.kv_a_proj_with_mqa.bias", "self_attn.o_proj.bias"]
        if latent.q_lora_rank is not None:
            names.append("self_attn.q_a_proj.bias")
    return same_names(*names)


def deepseek_v3_layer_tensors(spec: DeepseekV3Spec, index: int) -> list[LayerTensor]:
    """Layer ``index``'s tensors: MLA, then a dense feed-forward or router, experts and shared expert."""
    rows: list[LayerTensor] = [*_attention_names(spec)]
    if index < spec.moe.first_k_dense_replace:
        return rows + dense_mlp_names()
    rows += [
        TensorName(hf="mlp.gate.weight", d9d="mlp.router.weight"),
        TensorName(hf="mlp.gate.e_score_correction_bias", d9d="mlp.router.expert_bias"),
    ]
    for proj in _PROJECTIONS:
        experts = tuple(f"mlp.experts.{e}.{proj}.weight" for e in range(spec.num_experts))
        rows.append(StackedExperts(hf=experts, d9d=f"mlp.experts.{proj}"))
        rows.append(
            TensorName(hf=f"mlp.shared_experts.{proj}.weight", d9d=f"mlp.shared_expert.{proj}.weight")
        )
    return rows
