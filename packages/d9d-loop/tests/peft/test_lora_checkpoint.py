"""LoRA checkpoints hold the adapters (and trained extras) only, and resume exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lora_wide_job import LORA, run_wide, wide_config, write_base_model

from d9d.mesh.testing import run_distributed


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _saved_keys(step_dir: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


def _run(base: str, directory: str | None, max_steps: int, mesh: dict[str, int], peft: Any) -> dict[str, Any]:
    trainer: dict[str, Any] = {"peft": peft, "initialization": {"source": base}}
    if directory is not None:
        trainer["checkpoint"] = {"directory": directory, "every_steps": 2, "keep_last": 5}
    return run_wide(wide_config(max_steps=max_steps, mesh=mesh, **trainer))


@pytest.mark.parametrize(
    ("mesh", "world_size"),
    [
        ({}, 1),  # one process
        ({"data_parallel_shard": 2}, 2),  # FSDP shards the adapters with their layers
    ],
)
def test_lora_checkpoint_holds_adapters_only_and_resumes_exactly(
    tmp_path: Path, mesh: dict[str, int], world_size: int
) -> None:
    base = tmp_path / "base"
    write_base_model(base)
    run = str(tmp_path / "run")

    reference = run_distributed(_run, str(base), None, 4, mesh, LORA, world_size=world_size)[0]
    # the first leg stops after step 2 (its last checkpoint), as if killed there
    first = run_distributed(_run, str(base), run, 2, mesh, LORA, world_size=world_size)[0]
    resumed = run_distributed(_run, str(base), run, 4, mesh, LORA, world_size=world_size)[0]

    assert first["losses"] + resumed["losses"] == reference["losses"]
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    model_keys = {k for k in _saved_keys(tmp_path / "run" / "step_000000002") if k.startswith("model.")}
    assert model_keys == {
        "model.fc1.lora_A",
        "model.fc1.lora_B",
        "model.fc2.lora_A",
        "model.fc2.lora_B",
        "model.head.weight",  # peft.trainable
        "model.head.bias",
    }


def test_lora_checkpoint_is_under_a_tenth_of_a_full_one(tmp_path: Path) -> None:
    base = tmp_path / "base"
    write_base_model(base)
    run_distributed(_run, str(base), str(tmp_path / "lora"), 2, {}, LORA, world_size=1)
    run_distributed(_run, str(base), str(tmp_path / "full"), 2, {}, {"kind": "full"}, world_size=1)
    lora, full = _bytes(tmp_path / "lora" / "step_000000002"), _bytes(tmp_path / "full" / "step_000000002")
    print(f"LoRA checkpoint {lora} bytes, full checkpoint {full} bytes ({lora / full:.1%})")
    assert lora < 0.1 * full
