"""A ``torch.profiler`` window over chosen steps and ranks; nothing is created outside it."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from d9d.loop.config._observability import ProfilingConfig


class StepProfiler:
    """Profiles steps ``start_step .. start_step + steps - 1`` on this rank.

    The profiler starts at the window's first step and stops after its last one, so steps
    outside the window run without it. Each step in the window is a ``train_step#N`` range in
    the trace. The trace is written when the window closes, or at ``close()`` if the run ends
    inside it.
    """

    def __init__(self, config: ProfilingConfig, *, rank: int, device: torch.device) -> None:
        self._config = config
        self._rank = rank
        self._device = device
        self._profile: profile | None = None
        self._step_range: record_function | None = None
        self._first = config.start_step
        self._last = config.start_step + config.steps - 1

    def step_started(self, step: int) -> None:
        """Starts the profiler at the window's first step and marks each step in it."""
        if step == self._first and self._profile is None:
            activities = [ProfilerActivity.CPU]
            if self._device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profile = profile(
                activities=activities,
                record_shapes=self._config.record_shapes,
                profile_memory=self._config.memory,
            )
            self._profile.start()
        if self._profile is not None:
            self._step_range = record_function(f"train_step#{step}")
            self._step_range.__enter__()

    def step_finished(self, step: int) -> None:
        """Closes the step's range; after the window's last step, stops and writes the trace."""
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._profile is not None and step >= self._last:
            self._write(last=step)

    def close(self) -> None:
        """Writes a window the run ended inside of."""
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._profile is not None:
            self._write(last=None)

    def _write(self, *, last: int | None) -> None:
        profiler, self._profile = self._profile, None
        if profiler is None:
            return
        profiler.stop()
        directory = self._config.directory
        directory.mkdir(parents=True, exist_ok=True)
        end = f"{last}" if last is not None else "end"
        profiler.export_chrome_trace(str(directory / f"rank{self._rank}_steps{self._first}-{end}.json"))
        if self._config.memory and self._device.type == "cuda":
            snapshot = torch.cuda.memory_snapshot()
            path = directory / f"rank{self._rank}_memory_snapshot.pickle"
            with Path(path).open("wb") as f:
                pickle.dump(snapshot, f)
