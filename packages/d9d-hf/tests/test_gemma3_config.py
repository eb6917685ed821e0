"""Gemma 3 (text only): config.json in both rope spellings, what is refused, the bf16 embedding scale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.hf import Gemma3TextConfig, read_decoder_config
from d9d.hf._decoder import DecoderBackbone, StageLayout
from d9d.hf._families import DECODER_CONFIG_ADAPTER

TINY: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 32,
    "hidden_size": 24,  # sqrt(24) = 4.899 is 4.90625 in bf16
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "sliding_window": 3,
}
# the same model as transformers 4 wrote it and as transformers 5 writes it
LEGACY = {
    **TINY,
    "rope_theta": 100000.0,
    "rope_local_base_freq": 50.0,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    "sliding_window_pattern": 2,
    "cache_implementation": "hybrid",  # google/gemma-3-1b-pt writes it
}
PER_LAYER_TYPE = {
    **TINY,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    },
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}


@pytest.mark.parametrize("raw", [LEGACY, PER_LAYER_TYPE], ids=["legacy", "per_layer_type"])
def test_both_rope_spellings_give_local_and_global_layers_their_own_base(raw: dict[str, Any]) -> None:
    config = DECODER_CONFIG_ADAPTER.validate_python(raw)
    assert isinstance(config, Gemma3TextConfig)
    spec = config.decoder_spec()
    assert (spec.rope_theta, spec.alternate_rope_theta) == (100000.0, 50.0)
    assert spec.alternate_rope_layers == frozenset({0, 2})
    assert spec.rope_scaling is not None
    assert spec.embedding_multiplier == 24**0.5 and spec.round_embedding_multiplier
    windows = [
        config.build_decoder_layer(i, attention_backend="eager").self_attn.sliding_window for i in range(4)
    ]
    assert windows == [3, None, 3, None]


def test_the_export_is_read_by_transformers_as_the_same_model(tmp_path: Path) -> None:
    from transformers import Gemma3TextConfig as HFGemma3TextConfig

    exported = Gemma3TextConfig.model_validate(LEGACY).to_json_dict()
    theirs = HFGemma3TextConfig(**{k: v for k, v in exported.items() if k != "model_type"})
    assert theirs.rope_parameters == {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
    }
    assert theirs.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (
        Gemma3TextConfig.model_validate(exported).decoder_spec()
        == Gemma3TextConfig.model_validate(LEGACY).decoder_spec()
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),  # Gemma 2's logit soft-capping
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),  # EmbeddingGemma
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "rope_parameters.sliding_attention",
        ),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ],
)
def test_what_d9d_does_not_implement_is_refused_naming_the_field(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        DECODER_CONFIG_ADAPTER.validate_python({**TINY, **change})


def test_the_multimodal_gemma3_config_is_refused_naming_its_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gemma3", "text_config": {}}')
    with pytest.raises(ValueError, match="gemma3"):
        read_decoder_config(tmp_path)


def test_the_embedding_scale_is_rounded_to_the_embedding_dtype_as_transformers_does() -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    config = Gemma3TextConfig.model_validate(LEGACY)
    spec = config.decoder_spec()
    torch.manual_seed(0)
    backbone = DecoderBackbone(config, spec, StageLayout(layers=range(1), is_first=True, is_last=True))
    backbone = backbone.to(torch.bfloat16)
    theirs = Gemma3TextScaledWordEmbedding(32, 24, padding_idx=0, embed_scale=24**0.5).to(torch.bfloat16)
    assert backbone.embed_tokens is not None
    theirs.weight.data.copy_(backbone.embed_tokens.weight.data)
    ids = torch.arange(32).unsqueeze(0)
    assert torch.equal(backbone.embed(ids), theirs(ids))
