"""The configure-time check: log the estimate and refuse a job over its device, before any weight."""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from d9d.loop._batch_layout import BatchLayout
from d9d.loop.config._trainer import TrainerConfig
from d9d.loop.estimate._describe import DescribeMemoryContext, DescribeMemoryResult
from d9d.loop.estimate._estimate import estimate_memory
from d9d.loop.estimate._fit import check_fits, check_weights_fit
from d9d.loop.estimate._host_fit import check_host_fits
from d9d.loop.estimate._job import MemoryJob, OptimizerMemory
from d9d.loop.estimate._report import summary_line
from d9d.loop.estimate._shape import ModelMemoryShape
from d9d.mesh import MeshParameters

_NONE = OptimizerMemory(state_bytes=0)
"""No optimizer state: the weights-only check."""


class DescribesMemory(Protocol):
    """A model provider (``ModelProvider.describe_memory``)."""

    def describe_memory(self, context: DescribeMemoryContext) -> DescribeMemoryResult: ...


@runtime_checkable
class StatesSequenceLength(Protocol):
    """A data provider whose rows have a known length (``TokenDataProvider``)."""

    @property
    def sequence_length(self) -> int: ...


@runtime_checkable
class StatesOptimizerMemory(Protocol):
    """An optimizer provider that says what its optimizer keeps (``AutoOptimizerProvider``)."""

    def optimizer_memory(self, *, storage_bytes: int) -> OptimizerMemory: ...


def _check_weights_only(
    shape: ModelMemoryShape, *, trainer: TrainerConfig, mesh: MeshParameters, budget_bytes: int | None
) -> None:
    if budget_bytes is None:
        return
    # the weights need neither the sequence length nor the optimizer's state
    weights = MemoryJob(model=shape, mesh=mesh, sequence_length=1, peft=trainer.peft, optimizer=_NONE)
    check_weights_fit(weights, budget_bytes)


def check_memory_at_configure(
    *,
    model: DescribesMemory,
    data: object,
    optimizer: object,
    trainer: TrainerConfig,
    mesh: MeshParameters,
    budget_bytes: int | None,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
    processes_per_host: int = 1,
) -> None:
    """Logs the largest rank's estimated peak; refuses a job over ``budget_bytes`` (the device's
    free memory or per-process cap, ``device_budget_bytes``; None: no check, as on the CPU).

    Nothing is estimated (one line says why) when the model provider states no shape; when the
    data provider states no sequence length or the optimizer provider no state size, only the
    weights are checked against the budget.

    With the optimizer's moments offloaded, the host's share for this process (its free memory
    over ``processes_per_host``, the ranks started on it) must hold them too.

    Raises:
        MemoryFitError: When the peak (or, lacking a sequence length or optimizer state, the
            weights alone) exceeds the device's free memory or the per-process cap, saying by how
            much and which switch would make it fit.
        ValueError: When the offloaded moments exceed the host's share, naming both.
    """
    shape = model.describe_memory(DescribeMemoryContext(mesh=mesh)).shape
    if shape is None:
        logger.info("memory estimate: none (the model provider states no shape: describe_memory)")
        return
    if not isinstance(data, StatesSequenceLength) or not isinstance(optimizer, StatesOptimizerMemory):
        lacking = (
            "data provider states no sequence_length"
            if not isinstance(data, StatesSequenceLength)
            else ("optimizer provider states no optimizer_memory")
        )
        logger.info(f"memory estimate: none (the {lacking}); only the weights are checked")
        _check_weights_only(shape, trainer=trainer, mesh=mesh, budget_bytes=budget_bytes)
        return
    layout = BatchLayout.of(
        mesh, global_batch_size=trainer.global_batch_size, microbatch_size=trainer.microbatch_size
    )
    job = MemoryJob(
        model=shape,
        mesh=mesh,
        sequence_length=data.sequence_length,
        microbatch_size=trainer.microbatch_size,
        microbatches_per_step=layout.microbatches_per_step,
        peft=trainer.peft,
        optimizer=optimizer.optimizer_memory(storage_bytes=shape.storage_bytes),
    )
    estimates = estimate_memory(job)
    logger.info(summary_line(estimates))
    if budget_bytes is not None:
        check_fits(job, budget_bytes)
    check_host_fits(job, estimates, processes_per_host=processes_per_host)
