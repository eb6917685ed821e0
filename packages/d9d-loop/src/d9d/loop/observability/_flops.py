"""Model FLOPs utilization: the model provider states FLOPs per token, the device its peak."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from d9d.loop._rank_stages import RankStagesContext

ModelT = TypeVar("ModelT", bound=nn.Module)

# Dense bf16 tensor-core peaks (no sparsity) from the vendors' datasheets, by device-name fragment;
# the first fragment found in ``torch.cuda.get_device_name`` wins.
_BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989.4e12),
    ("H100", 989.4e12),
    ("H800", 989.4e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362.05e12),
)


@dataclass(kw_only=True, frozen=True)
class EstimateFlopsContext(RankStagesContext[ModelT]):
    """Input of ``ModelProvider.estimate_flops``: this rank's stages, built and parallelized.

    Attributes:
        dist_context: The job's distributed context.
        stages: This rank's stages and their models, in increasing stage order.
    """


@dataclass(kw_only=True, frozen=True)
class EstimateFlopsResult:
    """The model's training cost per token.

    Attributes:
        flops_per_token: FLOPs of forward and backward of the whole model (every stage) for one
            token, e.g. ``6 * parameters + 12 * layers * hidden * sequence`` for a transformer;
            None: unknown (no MFU is reported).
    """

    flops_per_token: float | None = None


def peak_flops_of(device: torch.device) -> float | None:
    """The dense bf16 peak of a known GPU in FLOP/s, or None (the CPU, an unknown device)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peak in _BF16_PEAK_FLOPS:
        if fragment in name:
            return peak
    return None


@dataclass(kw_only=True, frozen=True)
class FlopsBudget:
    """What MFU divides by: the model's FLOPs per token and the peak of all devices of the job."""

    flops_per_token: float
    peak_flops_per_device: float
    devices: int

    def utilization(self, tokens_per_second: float) -> float:
        """The fraction of the job's peak that ``tokens_per_second`` of training achieves."""
        return tokens_per_second * self.flops_per_token / (self.peak_flops_per_device * self.devices)
