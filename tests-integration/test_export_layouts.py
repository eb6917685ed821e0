"""Export writes one merged directory under every layout, pipeline parallelism included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from quickstart_job import load_quickstart, quickstart_config
from safetensors.torch import load_file, save_file
from test_pipelined_training import StagedMLP, StagedProvider

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed
from d9d.pipeline import PipelineStageInfo
from d9d.state_mappers import identity_mapper_from_module


class ExportingProvider(StagedProvider):
    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext[StagedMLP]
    ) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(
            state_mapper=identity_mapper_from_module(context.model),
            files={"config.json": json.dumps({"widths": [16, 32, 32, 32, 1]}).encode()},
        )


def _train_and_export(mesh: dict[str, int], schedule: dict[str, Any], source: str, target: str) -> None:
    qs = load_quickstart()
    raw = quickstart_config(
        mesh=mesh, trainer={"pipeline": schedule, "max_steps": 3, "initialization": {"source": source}}
    )
    raw["lr_scheduler"] = {"name": "constant"}
    config = ProjectConfig.model_validate(raw)
    with TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=ExportingProvider("hsdp"),
        task_provider=lambda ctx: qs.RegressionTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: qs.RegressionDataset(2048, 16),
            collator=qs.RegressionDataset.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure() as trainer:
        trainer.train()
        trainer.export(target)


def _exported(target: Path) -> dict[str, torch.Tensor]:
    index = json.loads((target / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(target / file_name)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


@pytest.mark.parametrize(
    ("mesh", "schedule", "world"),
    [
        ({"pipeline_parallel": 2, "data_parallel_shard": 2}, {"name": "1f1b"}, 4),  # PP=2 x FSDP=2
        ({"pipeline_parallel": 2}, {"name": "interleaved_1f1b", "stages_per_rank": 2}, 2),  # 2 stages/rank
    ],
)
def test_pipelined_export_is_one_directory_equal_to_one_process(
    tmp_path: Path, mesh: dict[str, int], schedule: dict[str, Any], world: int
) -> None:
    torch.manual_seed(0)
    full = StagedMLP(PipelineStageInfo(current_stage=0, num_stages=1))
    source = tmp_path / "init.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(source))
    run_distributed(_train_and_export, {}, {"name": "1f1b"}, str(source), str(tmp_path / "one"), world_size=1)
    run_distributed(
        _train_and_export,
        mesh,
        schedule,
        str(source),
        str(tmp_path / "many"),
        world_size=world,
        timeout_s=240,
    )
    reference, merged = _exported(tmp_path / "one"), _exported(tmp_path / "many")
    assert sorted(merged) == sorted(full.state_dict())
    for name, value in reference.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-4, atol=1e-6)
    assert json.loads((tmp_path / "many" / "config.json").read_text())["widths"][0] == 16
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_export_refuses_a_non_empty_target_before_any_work(tmp_path: Path) -> None:
    torch.manual_seed(0)
    full = StagedMLP(PipelineStageInfo(current_stage=0, num_stages=1))
    source = tmp_path / "init.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(source))
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(Exception, match="exists and is not empty; nothing was written"):
        run_distributed(_train_and_export, {}, {"name": "1f1b"}, str(source), str(target), world_size=1)
    assert (target / "keep.txt").read_text() == "mine"
