"""Device memory figures per step: current and peak allocation (host-side reads, no device sync)."""

from __future__ import annotations

import resource
import sys
from typing import Protocol

import torch

_GIB = float(1 << 30)


class AllocatorStats(Protocol):
    """The caching allocator's counters of one device (``torch.cuda``'s; a fake in tests)."""

    def allocated(self, device: torch.device) -> int:
        """Bytes allocated now."""
        ...

    def peak(self, device: torch.device) -> int:
        """The most bytes allocated since the last ``reset_peak``."""
        ...

    def reserved(self, device: torch.device) -> int:
        """Bytes the allocator holds."""
        ...

    def reset_peak(self, device: torch.device) -> None:
        """Starts a new peak from what is allocated now."""
        ...


class CudaAllocatorStats:
    """``torch.cuda``'s allocator counters."""

    def allocated(self, device: torch.device) -> int:
        """Bytes allocated now."""
        return torch.cuda.memory_allocated(device)

    def peak(self, device: torch.device) -> int:
        """The most bytes allocated since the last ``reset_peak``."""
        return torch.cuda.max_memory_allocated(device)

    def reserved(self, device: torch.device) -> int:
        """Bytes the allocator holds."""
        return torch.cuda.memory_reserved(device)

    def reset_peak(self, device: torch.device) -> None:
        """Starts a new peak from what is allocated now."""
        torch.cuda.reset_peak_memory_stats(device)


class DeviceMemory:
    """Reads the allocator's statistics of the job's device; the peak is reset after each read.

    On CUDA: ``memory/current_gib`` (allocated now), ``memory/peak_gib`` (the most allocated since
    the previous read, or for the first step since it started: loading and building the model
    are not a step's) and ``memory/reserved_gib`` (held by the caching allocator). On the CPU
    there is no allocator to ask: ``memory/host_peak_gib`` is the process's peak resident size.
    """

    def __init__(self, device: torch.device, allocator: AllocatorStats | None = None) -> None:
        self._device = device
        self._allocator = allocator if allocator is not None else CudaAllocatorStats()
        self._first_step = True

    def step_started(self) -> None:
        """Before the first step: forgets the peak of everything before it (loading, building)."""
        if self._first_step and self._device.type == "cuda":
            self._allocator.reset_peak(self._device)
        self._first_step = False

    def read(self) -> dict[str, float]:
        """The figures, by metric name."""
        match self._device.type:
            case "cuda":
                allocator, device = self._allocator, self._device
                figures = {
                    "memory/current_gib": allocator.allocated(device) / _GIB,
                    "memory/peak_gib": allocator.peak(device) / _GIB,
                    "memory/reserved_gib": allocator.reserved(device) / _GIB,
                }
                allocator.reset_peak(device)
                self._first_step = False
                return figures
            case _:
                return {"memory/host_peak_gib": _peak_resident_bytes() / _GIB}


def _peak_resident_bytes() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
