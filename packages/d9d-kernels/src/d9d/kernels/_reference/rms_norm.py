"""RMSNorm in plain PyTorch."""

from __future__ import annotations

import torch

from d9d.kernels._reference.precision import upcast


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_weight: bool
) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * w`` in fp32, returned in ``x.dtype``.

    ``w`` is ``weight``, or ``1 + weight`` when ``zero_centered_weight`` is set.
    """
    xf = upcast(x)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = upcast(weight)
    if zero_centered_weight:
        w = w + 1.0
    return (xf * rstd * w).to(x.dtype)
