"""Released Llama and Qwen2.5 config.json files, Mistral and Granite shapes -> the family and its numbers."""

from __future__ import annotations

import math
from typing import Any

import pytest

from d9d.hf import GraniteConfig, LlamaConfig, MistralConfig, Qwen2Config, ScratchModelConfig
from d9d.hf._families import DECODER_CONFIG_ADAPTER
from d9d.kernels.layers import Llama3RopeScaling, LongRopeScaling

# meta-llama/Llama-3.2-1B as released (transformers 4.45)
LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

# meta-llama/Meta-Llama-3-8B: no rope scaling, no head_dim, untied
LLAMA_3_8B: dict[str, Any] = {
    **{k: v for k, v in LLAMA_3_2_1B.items() if k not in ("head_dim", "mlp_bias")},
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_hidden_layers": 32,
    "rope_scaling": None,
    "tie_word_embeddings": False,
}

# Qwen/Qwen2.5-0.5B as released (transformers 4.40)
QWEN2_5_0_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Mistral 7B v0.1's shape: a 4096-token window on every layer
MISTRAL_7B: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

# a Granite 3.x 2B shape: the four multipliers, a tied head
GRANITE_2B: dict[str, Any] = {
    "architectures": ["GraniteForCausalLM"],
    "attention_bias": False,
    "attention_multiplier": 0.015625,
    "embedding_multiplier": 12.0,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "logits_scaling": 8.0,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "granite",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "rope_theta": 5000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49155,
}


def test_llama_3_2_scales_rope_with_llama3_and_ties_the_head() -> None:
    config = DECODER_CONFIG_ADAPTER.validate_python(LLAMA_3_2_1B)
    assert isinstance(config, LlamaConfig)
    spec = config.decoder_spec()
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, 64)
    assert spec.tie_word_embeddings and spec.rope_theta == 500000.0
    assert spec.rope_scaling == Llama3RopeScaling(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    assert config.hf_architecture("sequence_classification") == "LlamaForSequenceClassification"


def test_llama_3_without_head_dim_divides_the_width() -> None:
    spec = DECODER_CONFIG_ADAPTER.validate_python(LLAMA_3_8B).decoder_spec()
    assert spec.head_dim == 128 and spec.rope_scaling is None and not spec.tie_word_embeddings


def test_qwen2_5_has_full_attention_unless_use_sliding_window() -> None:
    config = DECODER_CONFIG_ADAPTER.validate_python(QWEN2_5_0_5B)
    assert isinstance(config, Qwen2Config)
    assert config.windows() == (None,) * 24
    assert config.decoder_spec().head_dim == 64
    sliding = Qwen2Config.model_validate({**QWEN2_5_0_5B, "use_sliding_window": True, "sliding_window": 8})
    assert sliding.windows() == (None,) * 24  # max_window_layers=24: no layer from 24 on
    assert Qwen2Config.model_validate(
        {**QWEN2_5_0_5B, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 22}
    ).windows()[21:] == (None, 8, 8)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({**LLAMA_3_2_1B, "architectures": ["Qwen2ForCausalLM"]}, "architectures"),  # another family's class
        ({**QWEN2_5_0_5B, "use_mrope": True}, "use_mrope"),  # Qwen2-VL's multimodal rope
        ({**LLAMA_3_2_1B, "unknown_field": 1}, "unknown_field"),  # extra="forbid"
        ({**LLAMA_3_2_1B, "model_type": "gpt2"}, "model_type"),  # a family d9d has not
        ({**MISTRAL_7B, "layer_types": ["sliding_attention"] * 32}, "layer_types"),  # Ministral's
        ({**GRANITE_2B, "logits_scaling": 0.0}, "logits_scaling"),
        ({**GRANITE_2B, "hidden_act": "gelu"}, "hidden_act"),
        ({**LLAMA_3_2_1B, "pad_token_id": LLAMA_3_2_1B["vocab_size"]}, "pad_token_id"),  # past the table
    ],
)
def test_a_config_outside_the_families_is_refused_naming_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DECODER_CONFIG_ADAPTER.validate_python(raw)


def test_mistral_slides_every_layer_and_granite_scales_embeddings_and_logits() -> None:
    mistral = DECODER_CONFIG_ADAPTER.validate_python(MISTRAL_7B)
    assert isinstance(mistral, MistralConfig) and mistral.sliding_window == 4096
    assert mistral.decoder_spec().head_dim == 128
    granite = DECODER_CONFIG_ADAPTER.validate_python(GRANITE_2B)
    assert isinstance(granite, GraniteConfig)
    spec = granite.decoder_spec()
    assert (spec.embedding_multiplier, spec.logits_multiplier) == (12.0, 1 / 8.0)
    assert spec.tie_word_embeddings and spec.head_dim == 64


def test_pretraining_from_scratch_takes_any_family() -> None:
    scratch = ScratchModelConfig.model_validate({"config": {**LLAMA_3_2_1B, "num_hidden_layers": 2}})
    assert isinstance(scratch.config, LlamaConfig)


_PHI3: dict[str, Any] = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4}
_LONGROPE = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {**_PHI3, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.7}},
            "partial_rotary_factor=0.7 of head_dim 16 rotates 11 channels; it must be a positive even number",
        ),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor=0.5 is not implemented for model_type LlamaConfig",
        ),
        ({**_PHI3, "resid_pdrop": 0.1}, "resid_pdrop"),
        ({**_PHI3, "embd_pdrop": 0.1}, "embd_pdrop"),
        (
            {**_PHI3, "rope_scaling": {**_LONGROPE, "long_factor": [2.0] * 7}},
            r"rope_scaling\.long_factor has 7 values; a rotary dim of 16 needs one per rotation plane, 8",
        ),
    ],
)
def test_phi3_refuses_what_it_does_not_implement_naming_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DECODER_CONFIG_ADAPTER.validate_python(raw)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": _LONGROPE},  # Phi-3-mini-128k
        {"rope_scaling": {**_LONGROPE, "type": "su"}},  # older files' name
        {"rope_parameters": {**_LONGROPE, "rope_type": "longrope", "rope_theta": 1e4}},  # transformers 5
    ],
    ids=["longrope", "su", "rope_parameters"],
)
def test_phi3_longrope_takes_hugging_faces_defaults(rope: dict[str, Any]) -> None:
    raw = {**_PHI3, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, **rope}
    scaling = DECODER_CONFIG_ADAPTER.validate_python(raw).decoder_spec().rope_scaling
    assert isinstance(scaling, LongRopeScaling)
    assert scaling.short_factor == (1.0,) * 8 and scaling.long_factor == (2.0,) * 8
    assert scaling.original_max_position_embeddings == 4096
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


@pytest.mark.parametrize(
    "partial",
    [
        {"partial_rotary_factor": 0.75},  # Phi-4-mini's config.json
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},  # transformers 5
    ],
    ids=["top-level", "rope_parameters"],
)
def test_phi4_mini_rotates_three_quarters_of_each_head(partial: dict[str, Any]) -> None:
    spec = DECODER_CONFIG_ADAPTER.validate_python({**_PHI3, **partial}).decoder_spec()
    assert spec.head_dim == 16 and spec.rotary_dim == 12


def test_phi3_with_plain_rope_and_a_whole_head_rotary_factor_is_accepted() -> None:
    # transformers 5 writes partial_rotary_factor: 1.0 into every Phi-3 rope block
    raw = {
        **_PHI3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
    }
    assert DECODER_CONFIG_ADAPTER.validate_python(raw).decoder_spec().rope_scaling is None


# the fields of the Hub's config.json files (factor lists shortened to constants of the right length)
_PHI3_HUB: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_phi3.Phi3Config",
        "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
    },
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2",
    "use_cache": True,
    "vocab_size": 32064,
}
_PHI35_MINI = {
    **_PHI3_HUB,
    "max_position_embeddings": 131072,
    "rope_scaling": {"long_factor": [1.5] * 48, "short_factor": [1.0] * 48, "type": "longrope"},
    "sliding_window": 262144,
}
_PHI4_MINI = {
    **_PHI35_MINI,
    "auto_map": {**_PHI3_HUB["auto_map"], "AutoTokenizer": "Xenova/gpt-4o"},
    "bos_token_id": 199999,
    "eos_token_id": 199999,
    "pad_token_id": 199999,
    "full_attn_mod": 1,
    "interpolate_factor": 1,
    "lm_head_bias": False,
    "mlp_bias": False,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75,
    "tie_word_embeddings": True,
    "vocab_size": 200064,
}


@pytest.mark.parametrize(
    ("raw", "rotary_dim", "long_context"),
    [(_PHI3_HUB, None, False), (_PHI35_MINI, None, True), (_PHI4_MINI, 96, True)],
    ids=["phi-3-mini-4k", "phi-3.5-mini", "phi-4-mini"],
)
def test_phi3_hub_files_load_and_export_without_their_custom_code_pointers(
    raw: dict[str, Any], rotary_dim: int | None, long_context: bool
) -> None:
    config = DECODER_CONFIG_ADAPTER.validate_python(raw)
    spec = config.decoder_spec()
    assert spec.head_dim == raw["hidden_size"] // raw["num_attention_heads"] and spec.rotary_dim == rotary_dim
    assert isinstance(spec.rope_scaling, LongRopeScaling) == long_context
    if isinstance(spec.rope_scaling, LongRopeScaling):  # Hugging Face's factor for 32x of 4096 positions
        assert spec.rope_scaling.attention_factor == pytest.approx(1.1902380714238083)
    exported = config.to_json_dict()
    assert "auto_map" not in exported
    for key, value in raw.items():
        if key not in ("auto_map", "rope_scaling") and value is not None:
            assert exported[key] == value, key
    if raw["rope_scaling"] is not None:
        assert exported["rope_scaling"]["long_factor"] == raw["rope_scaling"]["long_factor"]


# DeepSeek-V3's Hub config.json fields, less its FP8 quantization_config (refused on its own)
_DEEPSEEK_V3_HUB: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_deepseek_v3_hub_file_loads_with_its_custom_code_pointers() -> None:
    config = DECODER_CONFIG_ADAPTER.validate_python(_DEEPSEEK_V3_HUB)
    spec = config.decoder_spec()
    assert spec.num_layers == 61 and spec.has_experts and spec.rotary_dim == 64
    assert "auto_map" not in config.to_json_dict()
