"""The configurator runs the memory estimate before the model provider builds any stage."""

from __future__ import annotations

import logging

import pytest
from loop_toy_job import ToyDataset, ToyModel, ToyProvider, ToyTask, collate, toy_config
from test_memory_estimate import TINY

from d9d.loop import AutoDataProvider, AutoLRSchedulerProvider, AutoOptimizerProvider, TrainingConfigurator
from d9d.loop._model_provider import InitializeModelStageContext, InitializeModelStageResult
from d9d.loop.estimate import DescribeMemoryContext, DescribeMemoryResult


class _DescribedProvider(ToyProvider):
    """The toy model, stated as the tiny decoder shape; notes when a stage is built."""

    def __init__(self, events: list[str]) -> None:
        super().__init__("replicate")
        self.events = events

    def describe_memory(self, context: DescribeMemoryContext) -> DescribeMemoryResult:
        self.events.append("described")
        return DescribeMemoryResult(shape=TINY)

    def initialize_model_stage(
        self, context: InitializeModelStageContext
    ) -> InitializeModelStageResult[ToyModel]:
        self.events.append("built")
        return super().initialize_model_stage(context)


class _RowsOfFour(AutoDataProvider[object, object]):
    @property
    def sequence_length(self) -> int:
        return 4


def test_the_estimate_is_logged_before_any_stage_is_built(caplog: pytest.LogCaptureFixture) -> None:
    config = toy_config()
    events: list[str] = []
    configurator = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=_DescribedProvider(events),
        task_provider=lambda ctx: ToyTask(False),
        data_provider=_RowsOfFour(
            dataset_factory=lambda d: ToyDataset(64), collator=collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    )
    with caplog.at_level(logging.INFO, logger="d9d"), configurator.configure() as trainer:
        del trainer
    assert events[:2] == ["described", "built"]
    assert any("memory estimate: " in r.getMessage() for r in caplog.records)
