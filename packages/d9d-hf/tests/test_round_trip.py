"""HF -> d9d -> HF gives the same tensors, byte for byte, and an equivalent config.json."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import d9d.hf
from d9d.state_mappers import SafetensorsCheckpoint


def _tensors(directory) -> dict[str, bytes]:
    checkpoint = SafetensorsCheckpoint(directory)
    out: dict[str, bytes] = {}
    for file in checkpoint.files:
        with safe_open(file, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = handle.get_tensor(name)
                out[name] = tensor.dtype.__repr__().encode() + bytes(
                    tensor.contiguous().view(torch.uint8).numpy()
                )
    return out


def _config(directory) -> dict:
    from transformers import AutoConfig

    content = AutoConfig.from_pretrained(directory).to_dict()
    content.pop("transformers_version", None)
    content.pop("_name_or_path", None)
    return content


@pytest.mark.parametrize(
    ("name", "head"),
    [
        ("dense", "causal_lm"),  # biases, sliding windows, YaRN rope parameters
        ("tied", "causal_lm"),  # no lm_head.weight written, as transformers writes none
        ("moe", "causal_lm"),  # grouped experts back to per-expert tensors
        ("classifier", "sequence_classification"),  # score.weight
    ],
)
def test_round_trip_is_byte_identical(checkpoints, tmp_path, name, head) -> None:
    source = checkpoints[name]
    model = d9d.hf.load_pretrained(source, head=head)
    d9d.hf.save_pretrained(model, tmp_path / "out")

    assert _tensors(tmp_path / "out") == _tensors(source)
    assert _config(tmp_path / "out") == _config(source)
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["architectures"]
        == json.loads((source / "config.json").read_text())["architectures"]
    )


def test_transformers_loads_the_export_with_equal_logits(checkpoints, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = d9d.hf.load_pretrained(checkpoints["moe"])
    with torch.no_grad():  # change the weights so the export is not the source
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    d9d.hf.save_pretrained(model, tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model.logits(ids), atol=1e-5, rtol=1e-5)


def test_dtype_and_device_arguments(checkpoints) -> None:
    model = d9d.hf.load_pretrained(checkpoints["dense"], dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # rotary tables stay fp32
    reference = d9d.hf.load_pretrained(checkpoints["dense"])
    torch.testing.assert_close(
        model.model.layers["0"].self_attn.q_proj.weight,
        reference.model.layers["0"].self_attn.q_proj.weight.to(torch.bfloat16),
    )
