"""How much memory this process may allocate on its device: free memory, or the fraction cap."""

from __future__ import annotations

import torch


def device_budget_bytes(device: torch.device) -> int | None:
    """Bytes this process can still use on ``device``; None where there is no allocator to ask.

    On CUDA: the free memory (``torch.cuda.mem_get_info``) plus what this process's caching
    allocator already holds, capped by ``torch.cuda.set_per_process_memory_fraction``'s share of
    the device.
    """
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    budget = free + torch.cuda.memory_reserved(device)
    cap = int(torch.cuda.get_per_process_memory_fraction(device) * total)
    return min(budget, cap)
