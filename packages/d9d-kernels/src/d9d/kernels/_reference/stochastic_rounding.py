"""Stochastic rounding and the AdamW step in plain PyTorch."""

from __future__ import annotations

import math

import torch

_LOW_BITS = 1 << 16
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as a signed 32-bit integer


def stochastic_round_to_bf16_reference(source: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Rounds fp32 ``source`` to bf16 up or down in magnitude with probability given by the distance.

    Adds uniform random 16-bit noise to the low half of each fp32 bit pattern, then truncates: the
    result is the upper bf16 neighbour with probability (x - lower) / (upper - lower), so the rounding
    is unbiased in expectation. NaN and infinity pass through unchanged.
    """
    src = source.float().contiguous()
    noise = torch.randint(0, _LOW_BITS, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    rounded = ((src.view(torch.int32) + noise) & _HIGH_MASK).view(torch.float32)
    rounded = torch.where(torch.isfinite(src), rounded, src)
    return rounded.to(torch.bfloat16)


def _store(target: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    if target.dtype == torch.bfloat16:
        target.copy_(stochastic_round_to_bf16_reference(value, generator))
    else:
        target.copy_(value)


def adamw_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    generator: torch.Generator,
) -> None:
    """One decoupled-weight-decay Adam step in fp32, written back with stochastic rounding to bf16.

    Follows ``torch.optim.AdamW`` (no amsgrad): decay, moment updates, bias correction, update. Every
    bf16 tensor among ``param``, ``exp_avg`` and ``exp_avg_sq`` is written with stochastic rounding,
    fp32 ones exactly.
    """
    p = param.float() * (1.0 - lr * weight_decay)
    g = grad.float()
    m = exp_avg.float() * beta1 + g * (1.0 - beta1)
    v = exp_avg_sq.float() * beta2 + g * g * (1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = v.sqrt() / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * m / denom
    _store(exp_avg, m, generator)
    _store(exp_avg_sq, v, generator)
    _store(param, p, generator)
