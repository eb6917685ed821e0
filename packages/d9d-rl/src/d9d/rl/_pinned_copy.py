"""Host-to-device copies of small index tables that do not wait for the device."""

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``values`` (a list, or a rectangular list of lists) as an int64 tensor on ``device``, copied
    from pinned memory without waiting for the device (a plain copy from pageable memory would wait
    for the stream's queued work)."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
