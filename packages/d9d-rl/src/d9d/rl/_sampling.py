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
