"""Device memory figures per step: current and peak allocation (host-side reads, no device sync)."""

from __future__ import annotations

import resource
import sys

import torch

_GIB = float(1 << 30)


class DeviceMemory:
    """Reads the allocator's statistics of the job's device; the peak is reset after each read.

    On CUDA: ``memory/current_gib`` (allocated now), ``memory/peak_gib`` (the most allocated since
    the previous read) and ``memory/reserved_gib`` (held by the caching allocator). On the CPU
    there is no allocator to ask: ``memory/host_peak_gib`` is the process's peak resident size.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def read(self) -> dict[str, float]:
        """The figures, by metric name."""
        match self._device.type:
            case "cuda":
                figures = {
                    "memory/current_gib": torch.cuda.memory_allocated(self._device) / _GIB,
                    "memory/peak_gib": torch.cuda.max_memory_allocated(self._device) / _GIB,
                    "memory/reserved_gib": torch.cuda.memory_reserved(self._device) / _GIB,
                }
                torch.cuda.reset_peak_memory_stats(self._device)
                return figures
            case _:
                return {"memory/host_peak_gib": _peak_resident_bytes() / _GIB}


def _peak_resident_bytes() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
