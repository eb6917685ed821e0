"""``ModelProvider.optimizer_stepped`` runs after every applied optimizer step, on the new weights."""

from __future__ import annotations

import itertools

import torch
from loop_toy_job import ToyDataset, ToyModel, ToyProvider, ToyTask, collate, toy_config
from torch.distributed.tensor import DTensor

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    OptimizerSteppedContext,
    TrainingConfigurator,
)
from d9d.mesh.testing import run_distributed


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


class _Recording(ToyProvider):
    def __init__(self) -> None:
        super().__init__("fsdp")
        self.calls: list[tuple[int, list[torch.Tensor]]] = []

    def optimizer_stepped(self, context: OptimizerSteppedContext[ToyModel]) -> None:
        ((_, model),) = context.stages
        self.calls.append((context.step, _full(model)))


def _train() -> tuple[list[int], bool, bool]:
    config = toy_config(trainer={"max_steps": 3}, mesh={"data_parallel_shard": 2})
    provider = _Recording()
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=provider,
        task_provider=lambda ctx: ToyTask(False),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: ToyDataset(), collator=collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    trainer.train()
    final = _full(trainer.model_stages[0])
    trainer.close()
    weights = [w for _, w in provider.calls]
    changed = all(
        not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        for before, after in itertools.pairwise(weights)
    )
    latest = all(torch.equal(a, b) for a, b in zip(weights[-1], final, strict=True))
    return [step for step, _ in provider.calls], changed, latest


def test_optimizer_stepped_sees_each_applied_step_on_every_rank() -> None:
    for steps, changed, latest in run_distributed(_train, world_size=2, timeout_s=180):
        assert steps == [0, 1, 2]
        assert changed and latest
