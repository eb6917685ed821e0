"""Choosing the next token from logits: temperature, top-k, top-p, greedy."""

from __future__ import annotations

import torch

from d9d.rl._rollout_engine import SamplingParams


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Scales ``(rows, vocab)`` logits by the temperature and masks tokens outside top-k / top-p."""
    scaled = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_next(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """``(rows,)`` next tokens for ``(rows, vocab)`` logits."""
    if sampling.temperature == 0.0:
        return logits.argmax(dim=-1)
    probabilities = filter_logits(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


def _signed(value: int) -> int:
    """``value`` modulo 2**64 as a signed 64-bit integer (torch's int64)."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_GOLDEN_2 = _signed(2 * 0x9E3779B97F4A7C15)
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 bit patterns (multiplication wraps modulo 2**64)."""
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def keyed_gumbel_noise(seed: int, rows: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(len(rows), vocab)`` float64 Gumbel noise, a pure function of ``(seed, row, step, token)``.

    Each value comes from a counter-based hash, so a row's noise at a step does not depend on
    which other rows share the batch, their order, or how often the row was recomputed.

    Args:
        seed: The call's seed.
        rows: ``(n,)`` int64 row identities.
        steps: ``(n,)`` int64 index of the token being sampled in each row's completion.
        vocab: Vocabulary size.
    """
    base = _mix(torch.full_like(rows, _signed(seed)) + _GOLDEN)
    base = _mix(base ^ _mix(rows + _GOLDEN))
    base = _mix(base ^ _mix(steps + _GOLDEN_2))
    tokens = torch.arange(1, vocab + 1, dtype=torch.int64, device=rows.device) * _GOLDEN
    bits = _mix(base[:, None] + tokens[None, :])
    uniform = (_shift_right(bits, 11).double() + 0.5) * 2.0**-53
    return -torch.log(-torch.log(uniform))


def sample_keyed(
    logits: torch.Tensor, sampling: SamplingParams, *, seed: int, rows: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """``(n,)`` next tokens for ``(n, vocab)`` logits, each row's draw keyed by ``(seed, row, step)``.

    Gumbel-max over the filtered logits: the same distribution as ``sample_next``, but
    reproducible whatever the batch composition (continuous batching admits rows in any order).
    """
    if sampling.temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = filter_logits(logits, sampling).double()
    return (scaled + keyed_gumbel_noise(seed, rows, steps, logits.shape[-1])).argmax(dim=-1)
