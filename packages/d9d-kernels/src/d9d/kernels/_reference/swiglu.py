"""SwiGLU in plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from d9d.kernels._reference.precision import upcast


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` computed in fp32, returned in ``gate.dtype``."""
    return (F.silu(upcast(gate)) * upcast(up)).to(gate.dtype)
