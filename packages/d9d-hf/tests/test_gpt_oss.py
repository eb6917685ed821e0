"""GPT-OSS beyond the conformance rows: the load-balancing loss as transformers', refusals before any work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import d9d.hf
from d9d.hf import DecoderModel, GptOssConfig, causal_lm_targets
from d9d.hf._decoder import tensor_parallel_plan_of

TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 3,
}


@pytest.fixture(scope="module")
def aux_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-OSS whose config.json puts a large load-balancing loss into the objective."""
    from transformers import GptOssConfig as HFGptOssConfig
    from transformers import GptOssForCausalLM

    config = HFGptOssConfig(**TINY, output_router_logits=True, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    model = GptOssForCausalLM(config)
    with torch.no_grad():  # a router that prefers some experts, so the loss is far from its minimum
        for layer in model.model.layers:
            layer.mlp.router.weight.normal_(std=0.5)
            layer.mlp.router.bias.normal_()
    directory = tmp_path_factory.mktemp("gpt_oss") / "aux"
    model.save_pretrained(directory)
    return directory


def test_load_balancing_loss_equals_transformers(aux_checkpoint: Path, helpers: Any) -> None:
    hf = helpers.hf_model(aux_checkpoint).train()
    model = d9d.hf.load_pretrained(aux_checkpoint).train()
    assert isinstance(model, DecoderModel) and model.spec.load_balancing_coefficient == 0.5
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(7))
    out = hf(input_ids=ids, labels=ids)
    cross_entropy = F.cross_entropy(out.logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    assert out.aux_loss is not None and float(out.aux_loss.detach()) > 1.0  # unbalanced: it shows
    torch.testing.assert_close(out.loss, cross_entropy + 0.5 * out.aux_loss)
    out.loss.backward()

    loss = model.loss(ids, causal_lm_targets(ids))  # the value is the cross-entropy ...
    loss.backward()  # ... its gradient that of cross-entropy + 0.5 * the pooled loss
    torch.testing.assert_close(loss, cross_entropy, atol=1e-5, rtol=1e-5)
    helpers.assert_same_gradients(helpers.d9d_gradients(model), helpers.hf_gradients(hf))


def _config(directory: Path, **fields: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt_oss", **TINY, **fields}))
    return directory


def test_a_quantization_other_than_mxfp4_is_refused_naming_the_file_and_field(tmp_path: Path) -> None:
    directory = _config(tmp_path, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match=r"config\.json.*quantization_config.*'fp8': only MXFP4"):
        d9d.hf.read_decoder_config(directory)


def test_defaults_follow_transformers_and_tensor_parallelism_is_refused() -> None:
    config = GptOssConfig.model_validate({"model_type": "gpt_oss", **TINY, "num_hidden_layers": 3})
    assert config.resolved_layer_types() == ["sliding_attention", "full_attention", "sliding_attention"]
    spec = config.decoder_spec()
    assert spec.rope_theta == 150000.0 and spec.rope_scaling is not None  # transformers' yarn block
    assert tensor_parallel_plan_of(config, tensor_parallel=1) is None
    with pytest.raises(
        ValueError, match=r"model_type gpt_oss does not support mesh\.tensor_parallel=2: every"
    ):
        tensor_parallel_plan_of(config, tensor_parallel=2)
    with pytest.raises(ValueError, match="sliding_window is null"):
        GptOssConfig.model_validate({"model_type": "gpt_oss", **TINY, "sliding_window": None})


def test_the_layers_share_one_backend_picked_for_sinks() -> None:
    """One backend object for every layer (its caches shared), auto-detected as one that takes sinks."""
    config = GptOssConfig.model_validate({"model_type": "gpt_oss", **TINY, "num_hidden_layers": 3})
    assert config.decoder_spec().attention_sinks
    model = d9d.hf.DecoderCausalLM(config)
    backends = {id(layer.self_attn.attention_backend) for layer in model.model.layers.values()}
    assert len(backends) == 1
    backend = next(iter(model.model.layers.values())).self_attn.attention_backend
    assert hasattr(backend, "attend_with_sinks")
