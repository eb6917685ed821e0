"""config.json -> the resolved spec, for the shapes of released Qwen3 files."""

from __future__ import annotations

import pytest

from d9d.hf.qwen3 import Qwen3DenseConfig, Qwen3MoeConfig, qwen3_spec
from d9d.hf.qwen3._config import QWEN3_CONFIG_ADAPTER
from d9d.kernels.layers import YarnRopeScaling

# Qwen/Qwen3-0.6B's config.json as released (transformers 4.51: legacy rope fields)
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_released_dense_config() -> None:
    config = QWEN3_CONFIG_ADAPTER.validate_python(QWEN3_0_6B)
    spec = qwen3_spec(config)
    assert isinstance(config, Qwen3DenseConfig)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (16, 8, 128)
    assert spec.rope_theta == 1e6 and spec.rope_scaling is None
    assert spec.tie_word_embeddings and spec.moe is None
    assert spec.sliding_windows == (None,) * 28
    assert config.to_json_dict()["rope_theta"] == 1000000


def test_legacy_yarn_block_with_type() -> None:
    raw = {
        **QWEN3_0_6B,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    spec = qwen3_spec(QWEN3_CONFIG_ADAPTER.validate_python(raw))
    assert spec.rope_scaling == YarnRopeScaling(factor=4.0, original_max_position_embeddings=32768)


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        # sliding from max_window_layers on, only when use_sliding_window
        ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, (None, None, 8)),
        ({"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}, (None, None, None)),
        # explicit layer_types win
        (
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            },
            (8, None, 8),
        ),
    ],
)
def test_sliding_window_layers(fields, windows) -> None:
    config = Qwen3DenseConfig(model_type="qwen3", num_hidden_layers=3, **fields)
    assert qwen3_spec(config).sliding_windows == windows


@pytest.mark.parametrize(
    ("fields", "sparse"),
    [
        ({}, (True, True, True, True)),  # every layer sparse
        ({"decoder_sparse_step": 2}, (False, True, False, True)),  # every second layer
        ({"mlp_only_layers": [0, 3]}, (False, True, True, False)),  # listed layers dense
    ],
)
def test_moe_layers(fields, sparse) -> None:
    config = Qwen3MoeConfig(model_type="qwen3_moe", num_hidden_layers=4, num_experts=8, **fields)
    spec = qwen3_spec(config)
    assert spec.moe_layers == sparse
    assert spec.moe is not None and spec.moe.num_experts == 8


def test_num_local_experts_of_newer_files() -> None:
    config = Qwen3MoeConfig(model_type="qwen3_moe", num_local_experts=16)
    moe = qwen3_spec(config).moe
    assert moe is not None and moe.num_experts == 16


def test_attention_dropout_is_refused() -> None:
    with pytest.raises(ValueError, match="attention_dropout"):
        Qwen3DenseConfig(model_type="qwen3", attention_dropout=0.1)
