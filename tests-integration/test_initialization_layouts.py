"""Layout-invariant initialization: every layout, pipeline parallelism included, starts from the
exact weights of one process (docs/loop.md's promise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from quickstart_job import load_quickstart, quickstart_config
from safetensors.torch import load_file
from test_export_layouts import ExportingProvider

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed


def _configure_and_export(mesh: dict[str, int], schedule: dict[str, Any], target: str) -> None:
    qs = load_quickstart()
    raw = quickstart_config(mesh=mesh, trainer={"pipeline": schedule, "max_steps": 1, "seed": 11})
    raw["lr_scheduler"] = {"name": "constant"}
    config = ProjectConfig.model_validate(raw)
    with TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=ExportingProvider("hsdp"),
        task_provider=lambda ctx: qs.RegressionTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: qs.RegressionDataset(256, 16),
            collator=qs.RegressionDataset.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure() as trainer:
        trainer.export(target)  # right after configure(): the starting weights


def _exported(target: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize(
    ("mesh", "schedule", "world"),
    [
        ({"pipeline_parallel": 2, "data_parallel_shard": 2}, {"name": "1f1b"}, 4),  # PP=2 x FSDP=2
        ({"pipeline_parallel": 2}, {"name": "interleaved_1f1b", "stages_per_rank": 2}, 2),  # 2 stages/rank
    ],
)
def test_a_scratch_model_starts_from_the_single_process_weights_under_pipeline_parallelism(
    tmp_path: Path, mesh: dict[str, int], schedule: dict[str, Any], world: int
) -> None:
    # each stage seeded its own reset_parameters(): 30 of 47 tensors of a scratch Qwen3 differed
    run_distributed(_configure_and_export, {}, {"name": "1f1b"}, str(tmp_path / "one"), world_size=1)
    run_distributed(
        _configure_and_export, mesh, schedule, str(tmp_path / "many"), world_size=world, timeout_s=240
    )
    reference, layout = _exported(tmp_path / "one"), _exported(tmp_path / "many")
    assert sorted(layout) == sorted(reference) and len(reference) == 8
    for name, value in reference.items():
        assert torch.equal(layout[name], value), name
