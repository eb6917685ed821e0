"""A two-stage model trained with pipeline parallelism (pp=2, 1F1B) matches its non-pipelined run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from quickstart_job import load_quickstart, quickstart_config
from safetensors.torch import save_file
from torch import nn

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    EventBus,
    ForwardBackwardFinished,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    ParallelizeModelStageContext,
    ProjectConfig,
    TrainingConfigurator,
)
from d9d.mesh import DENSE_DOMAIN
from d9d.mesh.testing import run_distributed
from d9d.parallel import parallelize_hsdp
from d9d.state_mappers import identity_mapper_from_module


class TwoStageMLP(nn.Module):
    """The quickstart MLP cut in two: stage 0 holds ``fc1``, stage 1 ``fc2`` and ``out``."""

    def __init__(self, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.fc1 = nn.Linear(16, 32) if first else None
        self.fc2 = nn.Linear(32, 32) if last else None
        self.out = nn.Linear(32, 1) if last else None

    def forward(self, inputs: Any, shared: None) -> torch.Tensor:
        h = F.gelu(self.fc1(inputs.x)) if self.fc1 is not None else inputs
        if self.fc2 is None or self.out is None:
            return h
        return self.out(F.gelu(self.fc2(h)))

    def reset_parameters(self) -> None:
        for layer in (self.fc1, self.fc2, self.out):
            if layer is not None:
                layer.reset_parameters()


class TwoStageProvider(ModelProvider[TwoStageMLP]):
    def initialize_model_stage(
        self, context: InitializeModelStageContext
    ) -> InitializeModelStageResult[TwoStageMLP]:
        model = TwoStageMLP(first=context.stage.is_first, last=context.stage.is_last)
        return InitializeModelStageResult(model=model, state_mapper=identity_mapper_from_module(model))

    def parallelize_model_stage(self, context: ParallelizeModelStageContext[TwoStageMLP]) -> None:
        mesh = context.dist_context.mesh_for(DENSE_DOMAIN)
        parallelize_hsdp(context.model, mesh=mesh["dp_replicate", "dp_cp_shard", "cp_replicate"])


def _train(mesh: dict[str, int], schedule: dict[str, Any], source: str) -> list[float]:
    qs = load_quickstart()
    raw = quickstart_config(
        mesh=mesh, trainer={"pipeline": schedule, "max_steps": 6, "initialization": {"source": source}}
    )
    config = ProjectConfig.model_validate(raw)
    events = EventBus()
    losses: list[float] = []
    events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=TwoStageProvider(),
        task_provider=lambda ctx: qs.RegressionTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: qs.RegressionDataset(2048, 16),
            collator=qs.RegressionDataset.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        events=events,
    ).configure()
    trainer.train()
    trainer.close()
    trainer.dist_context.close()
    return losses


@pytest.mark.parametrize(
    ("mesh", "schedule", "world"),
    [
        ({"pipeline_parallel": 2}, {"name": "1f1b"}, 2),  # the pp=2, 1F1B
        ({"pipeline_parallel": 2}, {"name": "gpipe"}, 2),
        ({"pipeline_parallel": 2, "data_parallel_shard": 2}, {"name": "1f1b"}, 4),  # pp x FSDP
    ],
)
def test_pipelined_run_matches_non_pipelined(
    tmp_path: Path, mesh: dict[str, int], schedule: dict[str, Any], world: int
) -> None:
    # Both runs start from the same weights, loaded through the stages' state mappers: each
    # pipeline stage reads only its own tensors from the file.
    torch.manual_seed(0)
    full = TwoStageMLP(first=True, last=True)
    source = tmp_path / "init.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(source))
    reference = run_distributed(_train, {}, {"name": "1f1b"}, str(source), world_size=1)[0]
    curves = run_distributed(_train, mesh, schedule, str(source), world_size=world, timeout_s=240)
    assert len(reference) == 6
    for curve in curves:
        torch.testing.assert_close(torch.tensor(curve), torch.tensor(reference), rtol=1e-4, atol=0)
