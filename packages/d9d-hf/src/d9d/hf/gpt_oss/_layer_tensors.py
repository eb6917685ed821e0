"""GPT-OSS's name table: transformers' names, its experts' interleaved ``gate_up_proj`` split in two.

The checkpoint keeps each layer's experts as ``mlp.experts.gate_up_proj`` ``(E, H, 2I)`` (gate at
``[..., ::2]``, up at ``[..., 1::2]``), its bias ``(E, 2I)`` interleaved alike, and ``down_proj``
``(E, I, H)`` with its bias ``(E, H)``: the input dim first, as d9d's grouped experts hold them, so
only the interleaving is undone (``InterleavedTensor`` rows, state mappers both ways).
"""

from __future__ import annotations

from d9d.hf._decoder import InterleavedTensor, LayerTensor, attention_names, same_names


def gpt_oss_layer_tensors(*, attention_bias: bool, num_experts: int, hidden_size: int) -> list[LayerTensor]:
    """A layer's tensors: norms, q/k/v/o (and biases), sinks, the biased router and experts."""
    return [
        *attention_names(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False),
        *same_names(
            "self_attn.sinks",
            "mlp.router.weight",
            "mlp.router.bias",
            "mlp.experts.down_proj",
            "mlp.experts.down_proj_bias",
        ),
        InterleavedTensor(
            hf="mlp.experts.gate_up_proj",
            d9d=("mlp.experts.gate_proj", "mlp.experts.up_proj"),
            leading=(num_experts, hidden_size),
        ),
        InterleavedTensor(
            hf="mlp.experts.gate_up_proj_bias",
            d9d=("mlp.experts.gate_proj_bias", "mlp.experts.up_proj_bias"),
            leading=(num_experts,),
        ),
    ]
