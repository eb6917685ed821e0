"""The configure-time memory check: one log line, and a refusal before any weight when over."""

from __future__ import annotations

import logging

import pytest
from test_memory_estimate import TINY

from d9d.loop import AutoOptimizerProvider
from d9d.loop.config._optimizer import AdamWConfig, HostOffloadConfig, StochasticAdamWConfig
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
        _check(object(), 1 << 30)  # no sequence length: no estimate; the weights fit
    assert "memory estimate: none (the data provider states no sequence_length)" in caplog.text


def test_without_a_sequence_length_weights_over_the_device_are_still_refused() -> None:
    # the tiny model's 1720 bf16 weights need 3440 bytes, whatever the activations would add
    with pytest.raises(MemoryFitError, match=r"the weights alone need 0.00 GiB \(0.00 GiB of them frozen\)"):
        _check(object(), 3439)
    _check(object(), 3440)


def _check_offloaded(processes_per_host: int, resident_mib: int = 0) -> None:
    pytest.importorskip("d9d.kernels")
    offload = HostOffloadConfig(chunk_mib=1, resident_mib=resident_mib)
    check_memory_at_configure(
        model=_Shaped(),
        data=_Rows(),
        optimizer=AutoOptimizerProvider(StochasticAdamWConfig(offload=offload)),
        trainer=TRAINER,
        mesh=MeshParameters(),
        budget_bytes=None,
        logger=LOGGER,
        processes_per_host=processes_per_host,
    )


def test_offloaded_moments_that_fit_the_hosts_share_pass() -> None:
    _check_offloaded(processes_per_host=1)


def test_offloaded_moments_over_the_hosts_share_are_refused_before_loading() -> None:
    # so many processes on the host that each one's share of its free memory is 0 bytes
    with pytest.raises(
        ValueError, match=r"optimizer\.offload \(from the model's shape, before loading\): .* needs"
    ):
        _check_offloaded(processes_per_host=2**62)


def test_moments_kept_on_the_device_need_no_host_memory() -> None:
    _check_offloaded(processes_per_host=2**62, resident_mib=1024)  # TINY's moments are far smaller
