"""LoRA export: the merged plain model (base + scale * B @ A), or PEFT's adapter files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from loop_toy_job import Input
from lora_wide_job import LORA, WideModel, build_wide_trainer, wide_config, write_base_model
from safetensors.torch import load_file

from d9d.mesh.testing import run_distributed

SCALE = LORA["alpha"] / LORA["r"]


def _export(base: str, out: str, mesh: dict[str, int], export: str) -> dict[str, torch.Tensor]:
    config = wide_config(
        max_steps=3, mesh=mesh, peft={**LORA, "export": export}, initialization={"source": base}
    )
    trainer = build_wide_trainer(config)
    trainer.train()
    trainer.export(out)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    model = trainer.model_stages[0]
    model.eval()
    with torch.no_grad():
        y = model(Input(x=x), None)
    y = y.full_tensor() if hasattr(y, "full_tensor") else y
    trainer.close()
    return {"x": x, "y": y}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize(
    ("mesh", "world_size"),
    [
        ({}, 1),  # one process
        ({"data_parallel_shard": 2}, 2),  # FSDP: the merge runs on sharded DTensors
    ],
)
def test_merged_export_is_base_plus_scaled_b_a_and_adapters_export_is_peft_format(
    tmp_path: Path, mesh: dict[str, int], world_size: int
) -> None:
    base = tmp_path / "base"
    write_base_model(base)
    merged_dir, adapters_dir = tmp_path / "merged", tmp_path / "adapters"
    ran = run_distributed(_export, str(base), str(merged_dir), mesh, "merged", world_size=world_size)[0]
    run_distributed(_export, str(base), str(adapters_dir), mesh, "adapters", world_size=world_size)

    # PEFT's layout: two files, PEFT's tensor names, the LoRA hyper-parameters
    assert sorted(p.name for p in adapters_dir.iterdir()) == [
        ".d9d-export",  # the marker that lets a later export replace this directory
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    adapters = load_file(adapters_dir / "adapter_model.safetensors")
    width = WideModel().fc2.in_features
    assert {k: tuple(v.shape) for k, v in adapters.items()} == {
        "base_model.model.fc1.lora_A.weight": (2, 8),
        "base_model.model.fc1.lora_B.weight": (width, 2),
        "base_model.model.fc2.lora_A.weight": (2, width),
        "base_model.model.fc2.lora_B.weight": (width, 2),
        "base_model.model.head.weight": (1, width),  # peft.trainable: PEFT's modules_to_save
        "base_model.model.head.bias": (1,),
    }
    config: dict[str, Any] = json.loads((adapters_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (2, 4.0, 0.1)
    assert config["target_modules"] == ["fc1", "fc2"]
    assert config["modules_to_save"] == ["head"]
    assert config["base_model_name_or_path"] == str(base)

    # merged = base + alpha / r * B @ A, with the adapters of the same training
    original, merged = _tensors(base), _tensors(merged_dir)
    assert set(merged) == set(original)
    for layer in ("fc1", "fc2"):
        a, b = (
            adapters[f"base_model.model.{layer}.lora_A.weight"],
            adapters[f"base_model.model.{layer}.lora_B.weight"],
        )
        assert b.abs().max() > 0  # training moved B away from its zero start
        torch.testing.assert_close(merged[f"{layer}.weight"], original[f"{layer}.weight"] + SCALE * b @ a)
        torch.testing.assert_close(merged[f"{layer}.bias"], original[f"{layer}.bias"], rtol=0, atol=0)
    torch.testing.assert_close(
        merged["head.weight"], adapters["base_model.model.head.weight"], rtol=0, atol=0
    )

    # the merged export is a plain model giving the LoRA model's outputs
    plain = WideModel()
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(Input(x=ran["x"]), None), ran["y"], rtol=1e-5, atol=1e-6)
