"""Pooling a sequence of hidden states into one vector per row."""

from __future__ import annotations

from typing import Literal

import torch

Pooling = Literal["first", "last", "mean"]


def pool_hidden_states(
    hidden_states: torch.Tensor, pooling: Pooling, *, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Pools ``(batch, seq, hidden)`` to ``(batch, hidden)``.

    Args:
        hidden_states: Hidden states.
        pooling: ``"first"`` token, ``"last"`` real token, or ``"mean"`` over real tokens.
        attention_mask: ``(batch, seq)``; nonzero marks real tokens (padding may be on either side).
            None treats every token as real.

    Raises:
        ValueError: If a row has no real token.
    """
    if hidden_states.ndim != 3:
        raise ValueError(
            f"hidden_states must be (batch, seq, hidden), got shape {tuple(hidden_states.shape)}"
        )
    batch, seq, _ = hidden_states.shape
    if attention_mask is None:
        mask = torch.ones(batch, seq, dtype=torch.bool, device=hidden_states.device)
    else:
        if attention_mask.shape != (batch, seq):
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != (batch, seq) = {(batch, seq)}"
            )
        mask = attention_mask != 0
    # values are checked where there are values: a pipeline's shape pass runs on the meta device
    if not mask.is_meta and not bool(mask.any(dim=1).all()):
        raise ValueError("attention_mask has a row without any real token")
    rows = torch.arange(batch, device=hidden_states.device)
    positions = torch.arange(seq, device=hidden_states.device).expand(batch, seq)
    match pooling:
        case "first":
            first = torch.where(mask, positions, seq).min(dim=1).values
            return hidden_states[rows, first]
        case "last":
            last = torch.where(mask, positions, -1).max(dim=1).values
            return hidden_states[rows, last]
        case "mean":
            weights = mask.to(hidden_states.dtype).unsqueeze(-1)
            return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1)
