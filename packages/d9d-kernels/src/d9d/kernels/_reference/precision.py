"""The compute dtype of the references: fp32, or the input's own dtype when it is wider."""

from __future__ import annotations

import torch


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or unchanged when it already has at least fp32 precision (fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
