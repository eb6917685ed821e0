"""Linear layer followed by cross-entropy, in plain PyTorch (materializes the logits)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from d9d.kernels._reference.precision import upcast


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    reduction: Literal["mean", "sum", "none"],
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, computed in fp32.

    Returns per-token losses (N,) in fp32 with 0 at ignored tokens for "none", their sum for "sum",
    and their mean over non-ignored tokens for "mean" (0 when every token is ignored).
    """
    logits = upcast(hidden @ weight.T)
    losses = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")
    match reduction:
        case "none":
            return losses
        case "sum":
            return losses.sum()
        case "mean":
            count = (labels != ignore_index).sum().clamp(min=1)
            return losses.sum() / count
