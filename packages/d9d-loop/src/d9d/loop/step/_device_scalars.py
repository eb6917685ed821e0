"""Scalars placed on the device without making the host wait for the device."""

from __future__ import annotations

import torch


def device_scalar(value: torch.Tensor | float, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``value`` as a 0-d ``dtype`` tensor on ``device``, with no blocking copy from the host.

    ``torch.as_tensor(3.0, device="cuda")`` copies from pageable host memory, and such a copy
    waits for every kernel already queued on the stream: in the middle of a step it would hold
    the host until the backward has run, so the optimizer's launches could no longer overlap it.
    A Python number (or a CPU tensor, read on the host) becomes a fill kernel that carries the
    value as an argument; an accelerator tensor is converted on its device, unread.

    Args:
        value: A Python number, a CPU tensor or an accelerator tensor of one element.
        device: Where the result lives.
        dtype: The result's dtype.

    Returns:
        A 0-d tensor on ``device``.
    """
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.detach().to(device=device, dtype=dtype).reshape(())
    return torch.full((), float(value), dtype=dtype, device=device)
