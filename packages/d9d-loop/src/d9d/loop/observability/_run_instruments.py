"""What measures a run besides the loss: step metrics, the profiler window, GC control."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from d9d.loop._model_provider import ModelProvider
from d9d.loop._model_stage_factory import BuiltStage
from d9d.loop.config._trainer import TrainerConfig
from d9d.loop.observability._flops import EstimateFlopsContext, FlopsBudget, peak_flops_of
from d9d.loop.observability._gc_control import GarbageCollection
from d9d.loop.observability._profiler import StepProfiler
from d9d.loop.observability._step_metrics import StepEnd, StepMetrics, StepWork
from d9d.loop.observability._step_timing import StepPhase
from d9d.mesh import DistributedContext


@dataclass(kw_only=True)
class RunInstruments:
    """The trainer calls these at a step's start, phase ends and end; each part is optional.

    Attributes:
        metrics: Throughput, step-time split, MFU and memory figures.
        profiler: The profiler window (None: off, and nothing of torch.profiler is touched).
        garbage_collection: GC at fixed steps (None: Python's automatic collection as usual).
    """

    metrics: StepMetrics = field(default_factory=StepMetrics)
    profiler: StepProfiler | None = None
    garbage_collection: GarbageCollection | None = None

    def step_started(self, step: int) -> None:
        """Before a step's data is fetched."""
        if self.garbage_collection is not None:
            self.garbage_collection.step_started()
        if self.profiler is not None:
            self.profiler.step_started(step)
        self.metrics.start()

    def lap(self, phase: StepPhase) -> None:
        """At the end of ``phase`` of the current step."""
        self.metrics.lap(phase)

    def step_finished(self, step: int) -> StepEnd:
        """After the optimizer step is queued; returns the step's host-side measurements."""
        ended = self.metrics.end()
        if self.profiler is not None:
            self.profiler.step_finished(step)
        if self.garbage_collection is not None:
            self.garbage_collection.step_finished(step)
        return ended

    def figures(self, ended: StepEnd, work: StepWork) -> dict[str, float]:
        """The figures of an ended step by metric name, once its token count was read."""
        return self.metrics.figures(ended, work)

    def resumed(self) -> None:
        """After a resume or rollback: the gap to the previous step is not a checkpoint."""
        self.metrics.restart()

    def close(self) -> None:
        """Writes an unfinished profiler window and restores automatic GC."""
        if self.profiler is not None:
            self.profiler.close()
        if self.garbage_collection is not None:
            self.garbage_collection.close()


def build_run_instruments(
    config: TrainerConfig,
    *,
    dist_context: DistributedContext,
    provider: ModelProvider[Any],
    stages: Sequence[BuiltStage[Any]],
) -> RunInstruments:
    """The instruments ``config`` asks for on this rank; MFU when the provider states FLOPs per token."""
    estimate = provider.estimate_flops(
        EstimateFlopsContext(dist_context=dist_context, stages=[(s.stage, s.model) for s in stages])
    )
    peak = config.logging.peak_flops_per_device or peak_flops_of(dist_context.device)
    flops = None
    if estimate.flops_per_token is not None and peak is not None:
        flops = FlopsBudget(
            flops_per_token=estimate.flops_per_token,
            peak_flops_per_device=peak,
            devices=dist_context.world_size,
        )
    profiling = config.profiling
    profiler = None
    if profiling is not None and profiling.profiles_rank(dist_context.rank):
        profiler = StepProfiler(profiling, rank=dist_context.rank, device=dist_context.device)
    collection = config.garbage_collection
    return RunInstruments(
        metrics=StepMetrics(window=config.logging.throughput_window, device=dist_context.device, flops=flops),
        profiler=profiler,
        garbage_collection=GarbageCollection(collection) if collection is not None else None,
    )
