"""The attention backend slot: the contract every attention implementation fits."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionBackend(Protocol):
    """Computes softmax attention over already projected, rotated heads.

    ``GroupedQueryAttention.attention_backend`` holds one. Implementations here: eager (reference),
    SDPA, FlashAttention 2 and 4; d9d-parallel's context-parallel attention fits it structurally.
    """

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float,
        sliding_window: int | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attends queries to keys.

        Args:
            query: ``(batch, seq, q_heads, head_dim)``.
            key: ``(batch, seq, kv_heads, head_dim)``; ``q_heads % kv_heads == 0`` (query head ``h``
                uses key head ``h // (q_heads // kv_heads)``).
            value: Same shape as ``key``.
            causal: Token ``i`` attends only to ``j <= i``.
            softmax_scale: Multiplier of the scores before the softmax.
            sliding_window: ``w``: token ``i`` attends to ``j`` with ``i - w < j`` (and, when not
                causal, ``j < i + w``).
            document_ids: ``(batch, seq)`` integer ids; a token attends only to tokens of the same id.

        Returns:
            ``(batch, seq, q_heads, head_dim)`` in ``query.dtype``.
        """
        ...
