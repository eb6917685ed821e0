"""A model trained with pipeline parallelism (pp=2, several schedules) matches its non-pipelined run."""

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
from d9d.parallel import parallelize_hsdp, parallelize_replicate
from d9d.pipeline import PipelineStageInfo, layers_of_stage
from d9d.state_mappers import identity_mapper_from_module

WIDTHS = [16, 32, 32, 32, 1]  # four linear layers, GELU between them


class StagedMLP(nn.Module):
    """The quickstart-style MLP cut into pipeline stages; layer ``i`` is ``layers.<i>`` everywhere."""

    def __init__(self, stage: PipelineStageInfo) -> None:
        super().__init__()
        self.owned = list(layers_of_stage(stage, len(WIDTHS) - 1))
        self.last = stage.is_last
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTHS[i], WIDTHS[i + 1]) for i in self.owned})

    def forward(self, inputs: Any, shared: None) -> torch.Tensor:
        h = inputs.x if self.owned[0] == 0 else inputs
        for i in self.owned:
            h = self.layers[str(i)](h)
            if i < len(WIDTHS) - 2:
                h = F.gelu(h)
        return h

    def reset_parameters(self) -> None:
        for layer in self.layers.values():
            assert isinstance(layer, nn.Linear)
            layer.reset_parameters()


class StagedProvider(ModelProvider[StagedMLP]):
    def __init__(self, strategy: str) -> None:
        self.strategy = strategy

    def initialize_model_stage(
        self, context: InitializeModelStageContext
    ) -> InitializeModelStageResult[StagedMLP]:
        model = StagedMLP(context.stage)
        return InitializeModelStageResult(model=model, state_mapper=identity_mapper_from_module(model))

    def parallelize_model_stage(self, context: ParallelizeModelStageContext[StagedMLP]) -> None:
        mesh = context.dist_context.mesh_for(DENSE_DOMAIN)
        if self.strategy == "replicate":  # d9d's bucketed all-reduce instead of FSDP
            parallelize_replicate(context.model, mesh=mesh["dp_replicate"])
        else:
            parallelize_hsdp(context.model, mesh=mesh["dp_replicate", "dp_cp_shard", "cp_replicate"])


def _train(mesh: dict[str, int], schedule: dict[str, Any], source: str, strategy: str) -> list[float]:
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
        model_provider=StagedProvider(strategy),
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
    trainer.close()  # the trainer owns the context it built: this releases it too
    return losses


def _save_initial_weights(path: Path) -> Path:
    """The unpipelined MLP's weights (seed 0) in ``path``: every run of a test starts from them."""
    torch.manual_seed(0)
    full = StagedMLP(PipelineStageInfo(current_stage=0, num_stages=1))
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def initial_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights file every pipelined layout below starts from."""
    return _save_initial_weights(tmp_path_factory.mktemp("pipelined") / "init.safetensors")


@pytest.fixture(scope="module")
def reference_curve(initial_weights: Path) -> list[float]:
    """The non-pipelined single-process losses from ``initial_weights``, once for every layout."""
    return run_distributed(_train, {}, {"name": "1f1b"}, str(initial_weights), "hsdp", world_size=1)[0]


@pytest.mark.parametrize(
    ("mesh", "schedule", "world", "strategy"),
    [
        ({"pipeline_parallel": 2}, {"name": "1f1b"}, 2, "hsdp"),  # the pp=2, 1F1B
        ({"pipeline_parallel": 2}, {"name": "gpipe"}, 2, "hsdp"),
        ({"pipeline_parallel": 2, "data_parallel_shard": 2}, {"name": "1f1b"}, 4, "hsdp"),  # pp x FSDP
        # pp x replicated data parallelism (bucketed all-reduce in each stage's last backward)
        ({"pipeline_parallel": 2, "data_parallel_replicate": 2}, {"name": "1f1b"}, 4, "replicate"),
        # split backward: weight gradients accumulate in separate actions
        ({"pipeline_parallel": 2, "data_parallel_replicate": 2}, {"name": "zbv"}, 4, "replicate"),
        # split backward on FSDP stages (reduced once after each stage's last W), and on HSDP ones
        ({"pipeline_parallel": 2, "data_parallel_shard": 2}, {"name": "zbv"}, 4, "hsdp"),
        ({"pipeline_parallel": 2, "data_parallel_shard": 2}, {"name": "dualpipev"}, 4, "hsdp"),
        (
            {"pipeline_parallel": 2, "data_parallel_shard": 2},
            {"name": "interleaved_zero_bubble", "stages_per_rank": 1},  # ZB1P
            4,
            "hsdp",
        ),
        ({"pipeline_parallel": 2, "data_parallel_replicate": 2}, {"name": "zbv"}, 4, "hsdp"),
    ],
)
def test_pipelined_run_matches_non_pipelined(
    initial_weights: Path,
    reference_curve: list[float],
    mesh: dict[str, int],
    schedule: dict[str, Any],
    world: int,
    strategy: str,
) -> None:
    # Both runs start from the same weights, loaded through the stages' state mappers: each
    # pipeline stage reads only its own tensors from the file.
    source, reference = initial_weights, reference_curve
    curves = run_distributed(_train, mesh, schedule, str(source), strategy, world_size=world, timeout_s=240)
    assert len(reference) == 6
    for curve in curves:
        torch.testing.assert_close(torch.tensor(curve), torch.tensor(reference), rtol=1e-4, atol=0)


def _train_with_checkpoints(
    schedule: dict[str, Any], source: str, directory: str, max_steps: int
) -> list[float]:
    qs = load_quickstart()
    raw = quickstart_config(
        mesh={"pipeline_parallel": 2},
        trainer={
            "pipeline": schedule,
            "max_steps": max_steps,
            "initialization": {"source": source},
            "checkpoint": {"directory": directory, "every_steps": 2},
        },
    )
    raw["lr_scheduler"] = {"name": "constant"}  # the same schedule for runs of different lengths
    config = ProjectConfig.model_validate(raw)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=StagedProvider("hsdp"),
        task_provider=lambda ctx: qs.RegressionTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: qs.RegressionDataset(2048, 16),
            collator=qs.RegressionDataset.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    losses: list[float] = []
    trainer.events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
    trainer.train()
    trainer.close()  # the trainer owns the context it built: this releases it too
    return losses


@pytest.mark.parametrize(
    "schedule",
    [
        {"name": "1f1b"},
        {"name": "interleaved_1f1b", "stages_per_rank": 2},  # two stages per rank
    ],
)
def test_pipelined_run_checkpoints_and_resumes_exactly(tmp_path: Path, schedule: dict[str, Any]) -> None:
    source = _save_initial_weights(tmp_path / "init.safetensors")
    args = (schedule, str(source))
    straight = run_distributed(_train_with_checkpoints, *args, str(tmp_path / "a"), 6, world_size=2)
    run_distributed(_train_with_checkpoints, *args, str(tmp_path / "b"), 4, world_size=2)
    resumed = run_distributed(_train_with_checkpoints, *args, str(tmp_path / "b"), 6, world_size=2)
    assert resumed[0] == straight[0][4:]
