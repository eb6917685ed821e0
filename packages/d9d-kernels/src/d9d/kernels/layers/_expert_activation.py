"""The gated activation of SwiGLU experts: plain ``silu(gate) * up``, or GPT-OSS's clamped variant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from d9d.kernels import swiglu


@dataclass(kw_only=True, frozen=True)
class PlainSwiGLU:
    """``silu(gate) * up`` (Qwen, Mixtral, DeepSeek); d9d-kernels' fused ``swiglu`` op."""

    kind: Literal["swiglu"] = "swiglu"


@dataclass(kw_only=True, frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's experts: ``(up + 1) * gate * sigmoid(alpha * gate)`` on clamped inputs.

    ``gate`` is clamped from above at ``limit``, ``up`` to ``[-limit, limit]`` (no gradient beyond
    the clamp, as ``torch.clamp``).

    Attributes:
        alpha: Sigmoid gain (``swiglu_alpha``).
        limit: Clamp bound (``swiglu_limit``).
    """

    alpha: float = 1.702
    limit: float = 7.0
    kind: Literal["clamped_swiglu"] = "clamped_swiglu"


ExpertActivation = PlainSwiGLU | ClampedSwiGLU
"""The activation between the experts' gate/up and down products, told apart by ``kind``."""


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """``ClampedSwiGLU``'s formula in plain PyTorch (autograd through ``clamp`` and ``sigmoid``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def apply_expert_activation(
    activation: ExpertActivation, gate: torch.Tensor, up: torch.Tensor
) -> torch.Tensor:
    """``activation`` of the gate and up products, ``(rows, intermediate)`` each."""
    match activation:
        case PlainSwiGLU():
            return swiglu(gate, up)
        case ClampedSwiGLU(alpha=alpha, limit=limit):
            return clamped_swiglu(gate, up, alpha=alpha, limit=limit)
