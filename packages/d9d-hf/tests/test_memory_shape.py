"""The provider's statement for the memory estimate counts exactly transformers' parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from d9d.hf import HFModelProvider, ScratchModelConfig
from d9d.loop.estimate import DescribeMemoryContext, ModelMemoryShape
from d9d.mesh import MeshParameters

TINY: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "vocab_size": 128,
}
TINY_MOE: dict[str, Any] = {
    **TINY,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}

QWEN2: dict[str, Any] = {
    **{key: value for key, value in TINY.items() if key != "head_dim"},  # hidden / heads
    "model_type": "qwen2",
    "tie_word_embeddings": False,
}

DEEPSEEK_V3: dict[str, Any] = {
    **{key: value for key, value in TINY.items() if key != "head_dim"},  # MLA's own widths below
    "model_type": "deepseek_v3",
    "num_key_value_heads": 4,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 0,  # every layer sparse (layers that differ are stated as the largest)
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
}


def _shape(config: dict[str, Any]) -> ModelMemoryShape:
    provider = HFModelProvider(
        ScratchModelConfig.model_validate({"config": config, "master_dtype": "bfloat16"})
    )
    shape = provider.describe_memory(DescribeMemoryContext(mesh=MeshParameters())).shape
    assert shape is not None
    return shape


def _layer_parameters(shape: ModelMemoryShape) -> int:
    return sum(linear.numel for linear in shape.layer_linears) + shape.layer_other_parameters


def _stated_parameters(shape: ModelMemoryShape) -> int:
    head = 0 if shape.head is None else shape.head.numel
    return (
        shape.num_layers * _layer_parameters(shape)
        + shape.embedding_parameters
        + head
        + shape.other_parameters
    )


def _reference(config: dict[str, Any]) -> transformers.PreTrainedModel:
    fields = {key: value for key, value in config.items() if key != "model_type"}
    with torch.device("meta"):
        hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
        return transformers.AutoModelForCausalLM.from_config(hf_config)


@pytest.mark.parametrize(
    "config",
    [
        {**TINY, "tie_word_embeddings": False},  # an LM head of its own
        {**TINY, "tie_word_embeddings": True},  # the embedding's
        {**TINY, "model_type": "llama"},  # no q/k norms
        QWEN2,  # q/k/v biases, no q/k norms
        TINY_MOE,  # every layer sparse: stacked experts and a router
        DEEPSEEK_V3,  # latent attention, shared expert, a router's selection bias (a buffer)
    ],
    ids=["qwen3", "qwen3-tied", "llama", "qwen2", "qwen3-moe", "deepseek-v3"],
)
def test_shape_counts_every_parameter(config: dict[str, Any]) -> None:
    shape = _shape(config)
    assert _stated_parameters(shape) == sum(p.numel() for p in _reference(config).parameters())
    assert (shape.storage_bytes, shape.compute_bytes) == (2, 2)


def test_layers_that_differ_are_stated_as_the_largest() -> None:
    config = {**TINY_MOE, "mlp_only_layers": [0]}  # layer 0 dense, layer 1 sparse
    shape = _shape(config)
    sparse = _reference(config).get_submodule("model.layers.1")
    assert _layer_parameters(shape) == sum(p.numel() for p in sparse.parameters())
    # the most experts per token (the sparse layer's 2) and the widest feed-forward (the dense 64)
    assert (shape.experts_per_token, shape.ffn_width) == (2, 64)
    experts = [linear for linear in shape.layer_linears if linear.expert]
    assert [(linear.name, linear.count) for linear in experts] == [
        (f"model.layers.{{layer}}.mlp.experts.{name}", 4) for name in ("gate_proj", "up_proj", "down_proj")
    ]


def test_a_moe_config_without_sparse_layers_is_stated_dense() -> None:
    config = {**TINY_MOE, "mlp_only_layers": [0, 1]}
    shape = _shape(config)
    assert (shape.experts_per_token, shape.ffn_width) == (0, 64)
    assert not any(linear.expert for linear in shape.layer_linears)
    assert _stated_parameters(shape) == sum(p.numel() for p in _reference(config).parameters())
