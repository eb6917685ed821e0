"""The configure-time memory check: one log line, and a refusal before any weight when over."""

from __future__ import annotations

import logging

import pytest
from test_memory_estimate import TINY

from d9d.loop import AutoOptimizerProvider
from d9d.loop.config._optimizer import AdamWConfig
from d9d.loop.config._trainer import TrainerConfig
from d9d.loop.estimate import DescribeMemoryContext, DescribeMemoryResult, MemoryFitError
from d9d.loop.estimate._configure import check_memory_at_configure
from d9d.mesh import MeshParameters

TRAINER = TrainerConfig(max_steps=1, global_batch_size=2, microbatch_size=1)
LOGGER = logging.getLogger("test_memory_at_configure")


class _Shaped:
    def describe_memory(self, context: DescribeMemoryContext) -> DescribeMemoryResult:
        del context
        return DescribeMemoryResult(shape=TINY)


class _Rows:
    sequence_length = 4


def _check(data: object, budget: int | None) -> None:
    check_memory_at_configure(
        model=_Shaped(),
        data=data,
        optimizer=AutoOptimizerProvider(AdamWConfig()),
        trainer=TRAINER,
        mesh=MeshParameters(),
        budget_bytes=budget,
        logger=LOGGER,
    )


def test_logs_the_estimate_and_passes_within_budget(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        _check(_Rows(), 1 << 30)
    assert "memory estimate: 0.00 GiB peak" in caplog.text


def test_refuses_over_budget_naming_the_amount() -> None:
    with pytest.raises(MemoryFitError, match=r"over the device's 0.00 GiB by"):
        _check(_Rows(), 1000)


def test_says_why_nothing_is_estimated(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        _check(object(), 1000)  # no sequence length: no estimate, no refusal
    assert "memory estimate: none (the data provider states no sequence_length)" in caplog.text
