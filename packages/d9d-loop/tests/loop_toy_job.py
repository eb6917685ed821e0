"""A tiny regression job used by the d9d-loop tests (the test twin of the quickstart)."""

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
    EventBus,
    ForwardBackwardFinished,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    OptimizerProvider,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    ProjectConfig,
    StepFinished,
    Trainer,
    TrainingConfigurator,
    TrainTask,
)
from d9d.mesh import DENSE_DOMAIN
from d9d.parallel import parallelize_fsdp, parallelize_hsdp, parallelize_replicate
from d9d.state_mappers import identity_mapper_from_module


@dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Input:
    x: torch.Tensor


@dataclass
class State:
    y: torch.Tensor


class ToyDataset:
    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int) -> Sample:
        return Sample(x=self.x[index], y=self.y[index])


def collate(samples: list[Sample]) -> Batch:
    return Batch(x=torch.stack([s.x for s in samples]), y=torch.stack([s.y for s in samples]))


class ToyModel(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, inputs: Input, shared: None) -> torch.Tensor:
        # in the parameters' dtype (a model stored in bfloat16), the loss in float32
        return self.fc2(torch.tanh(self.fc1(inputs.x.to(self.fc1.weight.dtype)))).float()

    def reset_parameters(self) -> None:
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()


class ToyTask(TrainTask[Batch, Input, None, torch.Tensor, State]):
    """MSE; with ``weighted`` the loss is a per-sample sum weighted by the sample count."""

    def __init__(self, weighted: bool = False) -> None:
        self.weighted = weighted

    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[Batch]
    ) -> BuildForwardInputsResult[Input, None, State]:
        return BuildForwardInputsResult(
            input=Input(x=ctx.batch.x),
            shared=None,
            state=State(y=ctx.batch.y),
            num_tokens=ctx.batch.x.shape[0],
        )

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, State]) -> ComputeLossResult:
        loss = F.mse_loss(ctx.pipeline_results, ctx.state.y)
        weight = float(ctx.state.y.shape[0]) if self.weighted else None
        return ComputeLossResult(
            loss=loss,
            loss_weight=weight,
            metrics={"mae": float((ctx.pipeline_results.detach() - ctx.state.y).abs().mean())},
        )


class ToyProvider(ModelProvider[ToyModel]):
    def __init__(self, strategy: str = "hsdp", hidden: int = 16, dtype: torch.dtype = torch.float32) -> None:
        self.strategy = strategy
        self.hidden = hidden
        self.dtype = dtype

    def initialize_model_stage(
        self, context: InitializeModelStageContext
    ) -> InitializeModelStageResult[ToyModel]:
        model = ToyModel(self.hidden).to(self.dtype)
        return InitializeModelStageResult(model=model, state_mapper=identity_mapper_from_module(model))

    def parallelize_model_stage(self, context: ParallelizeModelStageContext[ToyModel]) -> None:
        mesh = context.dist_context.mesh_for(DENSE_DOMAIN)
        match self.strategy:
            case "hsdp":
                parallelize_hsdp(context.model, mesh=mesh["dp_replicate", "dp_cp_shard", "cp_replicate"])
            case "fsdp":
                parallelize_fsdp(context.model, mesh=mesh["dp_cp_shard"])
            case "replicate":
                parallelize_replicate(context.model, mesh=mesh["dp_replicate"])
            case _:
                raise ValueError(self.strategy)

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext[ToyModel]
    ) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(state_mapper=identity_mapper_from_module(context.model))


def toy_config(**sections: dict[str, Any]) -> ProjectConfig:
    raw: dict[str, Any] = {
        "trainer": {
            "max_steps": 4,
            "global_batch_size": 32,
            "microbatch_size": 8,
            "logging": {"progress_bar": False},
            "device": "cpu",  # gloo ranks on CPU even where a GPU exists
        },
        "optimizer": {"name": "adamw", "lr": 0.01},
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return ProjectConfig.model_validate(raw)


def build_trainer(
    config: ProjectConfig,
    *,
    events: EventBus | None = None,
    strategy: str = "hsdp",
    weighted: bool = False,
    hidden: int = 16,
    optimizer_provider: OptimizerProvider | None = None,
    samples: int = 512,
    dtype: torch.dtype = torch.float32,
) -> Trainer:
    return TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=ToyProvider(strategy, hidden, dtype),
        task_provider=lambda ctx: ToyTask(weighted),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: ToyDataset(samples), collator=collate, config=config.data
        ),
        optimizer_provider=optimizer_provider or AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        events=events,
    ).configure()


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in trainer.model_stages[0].named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = value.detach().clone()
    return out


def train_and_record(config: ProjectConfig, **build: Any) -> dict[str, Any]:
    """Trains the toy job; returns the losses, the gradient norms and the final full parameters."""
    events = EventBus()
    losses: list[float] = []
    norms: list[float] = []
    events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
    events.subscribe(StepFinished, lambda e: norms.append(e.metrics["grad_norm"]))
    trainer = build_trainer(config, events=events, **build)
    trainer.train()
    params = full_parameters(trainer)
    trainer.close()  # the trainer owns the context it built: this releases it too
    return {"losses": losses, "norms": norms, "params": params}


def assert_same_run(result: dict[str, Any], reference: dict[str, Any]) -> None:
    """Losses, norms and parameters of ``train_and_record`` runs agree (float32 reduction order)."""
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-7
    )
    torch.testing.assert_close(
        torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=1e-7
    )
    for name, value in reference["params"].items():
        torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)
