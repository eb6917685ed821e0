"""A tiny staged classifier with metrics, used by the evaluation, inference and LoRA tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    CreateMetricsContext,
    CreateMetricsResult,
    EvaluationData,
    EventBus,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    ProjectConfig,
    Trainer,
    TrainingConfigurator,
    TrainTask,
    UpdateMetricsContext,
)
from d9d.loop.metrics import Accuracy, BinaryAUROC, MulticlassScores
from d9d.mesh import DENSE_DOMAIN
from d9d.parallel import parallelize_hsdp
from d9d.pipeline import PipelineStageInfo, layers_of_stage
from d9d.state_mappers import identity_mapper_from_module

WIDTHS = [8, 16, 16, 16, 2]


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class Points:
    """Two noisy classes in 8 dimensions."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 2, (n,), generator=g)
        self.x = torch.randn(n, 8, generator=g) + 0.8 * self.y[:, None].float()

    def __len__(self) -> int:
        return self.y.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
    return Batch(x=torch.stack([s[0] for s in samples]), y=torch.stack([s[1] for s in samples]))


class StagedClassifier(nn.Module):
    def __init__(self, stage: PipelineStageInfo) -> None:
        super().__init__()
        self.owned = list(layers_of_stage(stage, len(WIDTHS) - 1))
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTHS[i], WIDTHS[i + 1]) for i in self.owned})

    def forward(self, inputs: Any, shared: None) -> torch.Tensor:
        h = inputs["x"] if self.owned[0] == 0 else inputs
        for i in self.owned:
            h = self.layers[str(i)](h)
            if i < len(WIDTHS) - 2:
                h = torch.tanh(h)
        return h

    def reset_parameters(self) -> None:
        for layer in self.layers.values():
            assert isinstance(layer, nn.Linear)
            layer.reset_parameters()


class StagedProvider(ModelProvider[StagedClassifier]):
    def initialize_model_stage(
        self, context: InitializeModelStageContext
    ) -> InitializeModelStageResult[StagedClassifier]:
        model = StagedClassifier(context.stage)
        return InitializeModelStageResult(model=model, state_mapper=identity_mapper_from_module(model))

    def parallelize_model_stage(self, context: ParallelizeModelStageContext[StagedClassifier]) -> None:
        mesh = context.dist_context.mesh_for(DENSE_DOMAIN)
        parallelize_hsdp(context.model, mesh=mesh["dp_replicate", "dp_cp_shard", "cp_replicate"])

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext[StagedClassifier]
    ) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(state_mapper=identity_mapper_from_module(context.model))


class ClassifierTask(TrainTask[Batch, dict[str, torch.Tensor], None, torch.Tensor, torch.Tensor]):
    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[Batch]
    ) -> BuildForwardInputsResult[dict[str, torch.Tensor], None, torch.Tensor]:
        return BuildForwardInputsResult(input={"x": ctx.batch.x}, shared=None, state=ctx.batch.y)

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, torch.Tensor]) -> ComputeLossResult:
        return ComputeLossResult(loss=F.cross_entropy(ctx.pipeline_results, ctx.state))

    def create_metrics(self, ctx: CreateMetricsContext) -> CreateMetricsResult:
        return CreateMetricsResult(
            metrics={"accuracy": Accuracy(), "auroc": BinaryAUROC(), "f1": MulticlassScores(num_classes=2)}
        )

    def update_metrics(self, ctx: UpdateMetricsContext[torch.Tensor, torch.Tensor]) -> None:
        logits, y = ctx.pipeline_results, ctx.state
        ctx.metrics["accuracy"].update(logits, y)
        ctx.metrics["auroc"].update(logits.softmax(-1)[:, 1], y)
        ctx.metrics["f1"].update(logits, y)


def classification_config(**sections: dict[str, Any]) -> ProjectConfig:
    raw: dict[str, Any] = {
        "trainer": {
            "max_steps": 4,
            "global_batch_size": 16,
            "microbatch_size": 4,
            "logging": {"progress_bar": False},
            "device": "cpu",
        },
        "optimizer": {"name": "adamw", "lr": 0.01},
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return ProjectConfig.model_validate(raw)


def build_classifier_trainer(
    config: ProjectConfig,
    *,
    events: EventBus | None = None,
    provider: ModelProvider[Any] | None = None,
    eval_samples: int = 45,
) -> Trainer:
    return TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider or StagedProvider(),
        task_provider=lambda ctx: ClassifierTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: Points(256), collator=collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        events=events,
        evaluation_data=EvaluationData(
            dataset_factory=lambda d: Points(eval_samples, seed=1), collator=collate
        ),
    ).configure()
