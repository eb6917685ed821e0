"""Per-step memory figures: each step's own peak, step 0 included (not the build's)."""

from __future__ import annotations

import torch

from d9d.loop.observability._step_metrics import StepMetrics

GIB = 1 << 30


class FakeAllocator:
    """An allocator whose live bytes the test sets; tracks the peak since the last reset."""

    def __init__(self) -> None:
        self.live = 0
        self.high = 0

    def use(self, live: int) -> None:
        self.live = live
        self.high = max(self.high, live)

    def allocated(self, device: torch.device) -> int:
        return self.live

    def peak(self, device: torch.device) -> int:
        return self.high

    def reserved(self, device: torch.device) -> int:
        return self.high

    def reset_peak(self, device: torch.device) -> None:
        self.high = self.live


def test_step_zero_reports_its_own_peak_not_the_builds() -> None:
    allocator = FakeAllocator()
    metrics = StepMetrics(device=torch.device("cuda", 0), allocator=allocator)
    allocator.use(10 * GIB)  # loading: a transient copy of the weights
    allocator.use(4 * GIB)  # the model, built
    metrics.start()
    allocator.use(6 * GIB)  # step 0's peak
    allocator.use(5 * GIB)
    assert metrics.end().memory["memory/peak_gib"] == 6.0
    metrics.start()
    allocator.use(7 * GIB)  # step 1's peak
    allocator.use(5 * GIB)
    assert metrics.end().memory["memory/peak_gib"] == 7.0
