"""Bad checkpoints are refused before any weight is read, naming the file and the key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import d9d.hf
from d9d.state_mappers import CheckpointFormatError


def _copy(source, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def _edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    content = json.loads(path.read_text())
    content.update(changes)
    path.write_text(json.dumps(content))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # another model family
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "model_type"),
        # the right family, an architecture d9d does not build
        ({"architectures": ["Qwen3ForTokenClassification"]}, "architectures"),
        # a rope method d9d does not implement
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters"),
        # an activation d9d does not implement
        ({"hidden_act": "gelu"}, "hidden_act"),
        # a field no Qwen3 config has
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(checkpoints, tmp_path, changes, message) -> None:
    directory = _copy(checkpoints["dense"], tmp_path)
    _edit_config(directory, **changes)
    with pytest.raises(ValueError, match=message) as error:
        d9d.hf.load_pretrained(directory)
    assert "config.json" in str(error.value)


def _rewrite_weights(directory, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoints, tmp_path) -> None:
    directory = _copy(checkpoints["dense"], tmp_path)
    _rewrite_weights(directory, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        d9d.hf.load_pretrained(directory)


def test_resized_vocabulary_is_named_with_its_file(checkpoints, tmp_path) -> None:
    directory = _copy(checkpoints["dense"], tmp_path)

    def resize(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.embed_tokens.weight"] = torch.zeros(130, 64)

    _rewrite_weights(directory, resize)
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor 'model\.embed_tokens\.weight' has shape \[130, 64\]"
    ):
        d9d.hf.load_pretrained(directory)


def test_index_naming_an_absent_shard_is_refused(checkpoints, tmp_path) -> None:
    directory = _copy(checkpoints["dense"], tmp_path)
    names = list(load_file(directory / "model.safetensors"))
    weight_map = dict.fromkeys(names, "model.safetensors")
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    with pytest.raises(CheckpointFormatError, match=r"model-00002-of-00002\.safetensors"):
        d9d.hf.load_pretrained(directory)


def test_missing_directory_is_not_sent_to_the_hub(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no such directory"):
        d9d.hf.load_pretrained(tmp_path / "absent")


def test_save_refuses_a_non_empty_directory(checkpoints, tmp_path) -> None:
    model = d9d.hf.load_pretrained(checkpoints["tied"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        d9d.hf.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()
