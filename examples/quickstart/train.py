"""d9d quickstart: regress a smooth function of 16 features with an MLP, on any number of ranks.

Run:        uv run examples/quickstart/train.py examples/quickstart/config.yaml
Scale out:  set `mesh: {data_parallel_shard: 4}` and run
            torchrun --nproc-per-node 4 examples/quickstart/train.py config.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    BuildForwardInputsContext,
    BuildForwardInputsResult,
    ComputeLossContext,
    ComputeLossResult,
    ConfigFileError,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    ProjectConfig,
    TrainingConfigurator,
    TrainTask,
)
from d9d.mesh import DENSE_DOMAIN
from d9d.parallel import parallelize_hsdp
from d9d.state_mappers import identity_mapper_from_module

NOISE_STD = 0.1  # the data's noise floor is NOISE_STD**2 = 0.01


@dataclass
class RegressionSample:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class RegressionBatch:
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class RegressionInput:
    x: torch.Tensor


@dataclass
class RegressionState:
    y: torch.Tensor


class RegressionDataset(Dataset[RegressionSample]):
    """``y = teacher(x) + noise``: a fixed random two-layer network plus Gaussian noise."""

    def __init__(self, num_samples: int, num_features: int, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, num_features, generator=generator)
        w1 = torch.randn(num_features, 8, generator=generator) / num_features**0.5
        w2 = torch.randn(8, 1, generator=generator) / 8**0.5
        clean = torch.tanh(self.x @ w1) @ w2
        self.y = clean + NOISE_STD * torch.randn(num_samples, 1, generator=generator)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int) -> RegressionSample:
        return RegressionSample(x=self.x[index], y=self.y[index])

    @staticmethod
    def collate(samples: list[RegressionSample]) -> RegressionBatch:
        return RegressionBatch(x=torch.stack([s.x for s in samples]), y=torch.stack([s.y for s in samples]))


class MLP(nn.Module):
    def __init__(self, num_features: int, hidden_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(num_features, hidden_size)
        self.fc2 = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, inputs: RegressionInput, shared: None) -> torch.Tensor:
        del shared
        return self.out(F.gelu(self.fc2(F.gelu(self.fc1(inputs.x)))))

    def reset_parameters(self) -> None:
        for layer in (self.fc1, self.fc2, self.out):
            layer.reset_parameters()


class RegressionTask(TrainTask[RegressionBatch, RegressionInput, None, torch.Tensor, RegressionState]):
    def build_forward_inputs(
        self, ctx: BuildForwardInputsContext[RegressionBatch]
    ) -> BuildForwardInputsResult[RegressionInput, None, RegressionState]:
        return BuildForwardInputsResult(
            input=RegressionInput(x=ctx.batch.x), shared=None, state=RegressionState(y=ctx.batch.y)
        )

    def compute_loss(self, ctx: ComputeLossContext[torch.Tensor, RegressionState]) -> ComputeLossResult:
        return ComputeLossResult(loss=F.mse_loss(ctx.pipeline_results, ctx.state.y), loss_weight=None)


class MLPProvider(ModelProvider[MLP]):
    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult[MLP]:
        model = MLP(num_features=16, hidden_size=64)
        return InitializeModelStageResult(model=model, state_mapper=identity_mapper_from_module(model))

    def parallelize_model_stage(self, context: ParallelizeModelStageContext[MLP]) -> None:
        mesh = context.dist_context.mesh_for(DENSE_DOMAIN)
        parallelize_hsdp(context.model, mesh=mesh["dp_replicate", "dp_cp_shard", "cp_replicate"])

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext[MLP]
    ) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(state_mapper=identity_mapper_from_module(context.model))


USAGE = "usage: train.py CONFIG.yaml  (e.g. examples/quickstart/config.yaml)"


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    try:
        config = ProjectConfig.from_yaml(sys.argv[1])
    except ConfigFileError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=MLPProvider(),
        task_provider=lambda ctx: RegressionTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda dist_context: RegressionDataset(65536, 16),
            collator=RegressionDataset.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    with trainer:  # releases the process group before the interpreter shuts down
        trainer.train()


if __name__ == "__main__":
    main()
