"""A regression job on a wider model, so that adapters are a small part of it (LoRA checkpoints)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from loop_toy_job import Input, Sample, collate
from loop_toy_job import ToyTask as WideTask
from torch import nn

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    ForwardBackwardFinished,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    ProjectConfig,
    Trainer,
    TrainingConfigurator,
)
from d9d.mesh import DENSE_DOMAIN
from d9d.parallel import parallelize_fsdp
from d9d.state_mappers import identity_mapper_from_module, save_module_state

WIDTH = 512
LORA = {"kind": "lora", "target": "fc1|fc2", "r": 2, "alpha": 4.0, "dropout": 0.1, "trainable": "head"}


class WideDataset:
    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int) -> Sample:
        return Sample(x=self.x[index], y=self.y[index])


class WideModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, inputs: Input, shared: None) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(inputs.x)))))

    def reset_parameters(self) -> None:
        for layer in (self.fc1, self.fc2, self.head):
            layer.reset_parameters()


class WideProvider(ModelProvider[WideModel]):
    def initialize_model_stage(
        self, context: InitializeModelStageContext
    ) -> InitializeModelStageResult[WideModel]:
        model = WideModel()
        return InitializeModelStageResult(model=model, state_mapper=identity_mapper_from_module(model))

    def parallelize_model_stage(self, context: ParallelizeModelStageContext[WideModel]) -> None:
        parallelize_fsdp(context.model, mesh=context.dist_context.mesh_for(DENSE_DOMAIN)["dp_cp_shard"])

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext[WideModel]
    ) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(state_mapper=identity_mapper_from_module(context.model))


def write_base_model(directory: Path) -> None:
    """A safetensors 'pretrained' base model (seeded), the source LoRA runs start from."""
    torch.manual_seed(123)
    save_module_state(directory, WideModel(), identity_mapper_from_module(WideModel()), show_progress=False)


def wide_config(*, max_steps: int, mesh: dict[str, int] | None = None, **trainer: Any) -> ProjectConfig:
    return ProjectConfig.model_validate(
        {
            "mesh": mesh or {},
            "trainer": {
                "max_steps": max_steps,
                "global_batch_size": 16,
                "microbatch_size": 4,
                "logging": {"progress_bar": False},
                "device": "cpu",
                **trainer,
            },
            "optimizer": {"name": "adamw", "lr": 0.01},
            "lr_scheduler": {"name": "constant"},
        }
    )


def build_wide_trainer(config: ProjectConfig) -> Trainer:
    return TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=WideProvider(),
        task_provider=lambda ctx: WideTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: WideDataset(), collator=collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()


def run_wide(config: ProjectConfig) -> dict[str, Any]:
    """Trains; returns the losses and the final full parameters."""
    trainer = build_wide_trainer(config)
    losses: list[float] = []
    trainer.events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
    trainer.train()
    params: dict[str, torch.Tensor] = {}
    for name, p in trainer.model_stages[0].named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name] = value.detach().clone()
    trainer.close()
    return {"losses": losses, "params": params}
