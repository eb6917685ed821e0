"""The per-step figures beyond the loss: throughput, step-time split, MFU, device memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from d9d.loop.observability._device_memory import AllocatorStats, DeviceMemory
from d9d.loop.observability._flops import FlopsBudget
from d9d.loop.observability._step_timing import StepPhase, StepTimer, StepTimes
from d9d.loop.observability._throughput import SmoothedThroughput


@dataclass(kw_only=True, frozen=True)
class StepWork:
    """What one step did, over all ranks: samples, and tokens when the task counts them (else 0)."""

    samples: float
    tokens: float


@dataclass(kw_only=True, frozen=True)
class StepEnd:
    """What is measured on the host when a step's work is queued: its times and device memory."""

    times: StepTimes
    memory: dict[str, float]


class StepMetrics:
    """Measures steps with host clocks and the allocator's counters; adds no device sync.

    Metrics per step: ``samples_per_s`` and ``tokens_per_s`` (smoothed over ``window`` steps;
    tokens only when the task reports them), ``time/{data,forward_backward,optimizer,checkpoint,
    step}_s`` (this step alone), ``mfu`` (with a ``FlopsBudget`` and token counts) and the
    device memory figures of ``DeviceMemory``.
    """

    def __init__(
        self,
        *,
        window: int = 50,
        device: torch.device | None = None,
        flops: FlopsBudget | None = None,
        clock: Callable[[], float] = time.perf_counter,
        allocator: AllocatorStats | None = None,
    ) -> None:
        """Sets up the timer, the throughput window and the memory reader.

        Args:
            window: Steps the throughput is smoothed over.
            device: Whose memory figures to read (None: none).
            flops: Turns tokens per second into MFU (None: no MFU).
            clock: Seconds of a monotonic host clock (replaceable in tests).
            allocator: The device allocator's counters (None: ``torch.cuda``'s).
        """
        self._timer = StepTimer(clock)
        self._throughput = SmoothedThroughput(window)
        self._memory = DeviceMemory(device, allocator) if device is not None else None
        self._flops = flops

    def start(self) -> None:
        """Marks the start of a step (before the first: the memory peak starts anew)."""
        self._timer.start()
        if self._memory is not None:
            self._memory.step_started()

    def lap(self, phase: StepPhase) -> None:
        """Marks the end of ``phase`` of the current step."""
        self._timer.lap(phase)

    def restart(self) -> None:
        """Forgets the gap to the previous step (after a resume or a rollback)."""
        self._timer.forget_previous()

    def end(self) -> StepEnd:
        """Marks the end of the step: its times and memory figures, read without a device sync."""
        return StepEnd(
            times=self._timer.finish(), memory=self._memory.read() if self._memory is not None else {}
        )

    def figures(self, ended: StepEnd, work: StepWork) -> dict[str, float]:
        """The figures of an ended step by metric name, once its work (token count) is known."""
        times = ended.times
        self._throughput.add(seconds=times.wall, samples=work.samples, tokens=work.tokens)
        metrics = {"samples_per_s": self._throughput.samples_per_second}
        if work.tokens > 0:
            tokens_per_second = self._throughput.tokens_per_second
            metrics["tokens_per_s"] = tokens_per_second
            if self._flops is not None:
                metrics["mfu"] = self._flops.utilization(tokens_per_second)
        metrics |= {
            "time/data_s": times.data,
            "time/forward_backward_s": times.forward_backward,
            "time/optimizer_s": times.optimizer,
            "time/checkpoint_s": times.checkpoint,
            "time/step_s": times.wall,
        }
        return metrics | ended.memory
