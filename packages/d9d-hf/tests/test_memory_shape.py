"""The provider's statement for the memory estimate counts exactly transformers' parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from d9d.hf import HFModelProvider, ScratchModelConfig
from d9d.loop.estimate import DescribeMemoryContext
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


@pytest.mark.parametrize("tied", [False, True])  # an LM head of its own, or the embedding's
def test_shape_counts_every_parameter(tied: bool) -> None:
    config = {**TINY, "tie_word_embeddings": tied}
    provider = HFModelProvider(
        ScratchModelConfig.model_validate({"config": config, "master_dtype": "bfloat16"})
    )
    shape = provider.describe_memory(DescribeMemoryContext(mesh=MeshParameters())).shape
    assert shape is not None
    layer = sum(linear.numel for linear in shape.layer_linears) + shape.layer_other_parameters
    head = 0 if shape.head is None else shape.head.numel
    stated = shape.num_layers * layer + shape.embedding_parameters + head + shape.other_parameters
    with torch.device("meta"):
        reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    assert stated == sum(p.numel() for p in reference.parameters())
    assert (shape.storage_bytes, shape.compute_bytes) == (2, 2)
