"""Pooling a sequence of hidden states into one vector per row."""

from __future__ import annotations

from typing import Literal

import torch

Pooling = Literal["first", "last", "mean"]


def check_pooling_mask(attention_mask: torch.Tensor) -> None:
    """Refuses a mask with a row without any real token (nothing to pool).

    Reads the mask's values: call it on the host, where the batch is built (on an accelerator's
    tensor it waits for the device). ``pool_hidden_states`` calls it itself on a host mask.

    Args:
        attention_mask: ``(batch, seq)``, nonzero on real tokens.

    Raises:
        ValueError: Naming the first row without a real token.
    """
    empty = ((attention_mask != 0).sum(dim=-1) == 0).nonzero().flatten()
    if empty.numel() > 0:
        raise ValueError(f"attention_mask row {int(empty[0])} is without any real token (nothing to pool)")


def pool_hidden_states(
    hidden_states: torch.Tensor,
    pooling: Pooling,
    *,
    attention_mask: torch.Tensor | None = None,
    check: bool | None = None,
) -> torch.Tensor:
    """Pools ``(batch, seq, hidden)`` to ``(batch, hidden)``.

    By default a mask on the host (CPU) is checked here (``check_pooling_mask``); on an
    accelerator its values are not read back (that would wait for the device every step): check
    it once where the batch is built. An unchecked row without a real token pools to NaN.

    Args:
        hidden_states: Hidden states.
        pooling: ``"first"`` token, ``"last"`` real token, or ``"mean"`` over real tokens.
        attention_mask: ``(batch, seq)``; nonzero marks real tokens (padding may be on either side).
            None treats every token as real.
        check: Whether to check the mask's values (``check_pooling_mask``): None checks a host
            mask only, True any mask (an accelerator's waits for the device), False none.

    Raises:
        ValueError: If the shapes differ, or a checked mask has a row without a real token.
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
        if check or (check is None and mask.device.type == "cpu"):  # host memory waits for nothing
            check_pooling_mask(mask)
    rows = torch.arange(batch, device=hidden_states.device)
    positions = torch.arange(seq, device=hidden_states.device).expand(batch, seq)
    match pooling:
        case "first":
            first = torch.where(mask, positions, seq).min(dim=1).values.clamp(max=seq - 1)
            pooled = hidden_states[rows, first]
        case "last":
            last = torch.where(mask, positions, -1).max(dim=1).values
            pooled = hidden_states[rows, last]
        case "mean":
            weights = mask.to(hidden_states.dtype).unsqueeze(-1)
            return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1)  # 0 / 0: NaN when empty
    if attention_mask is None:
        return pooled
    # a row without a real token (unchecked on an accelerator) is NaN, not some other token's state
    return torch.where(mask.any(dim=1, keepdim=True), pooled, torch.nan)
