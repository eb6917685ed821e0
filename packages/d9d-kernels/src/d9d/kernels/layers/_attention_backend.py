"""The attention backend slot: the contract every attention implementation fits."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionBackend(Protocol):
    """Computes softmax attention over already projected, rotated heads.

    ``GroupedQueryAttention.attention_backend`` holds one. Implementations here: eager (reference),
    SDPA, FlashAttention 2 and 4; d9d-parallel's context-parallel attention fits it structurally.

    The mask, the one meaning of ``causal``, ``sliding_window`` and ``document_ids`` for every
    implementation (consumers restate the signature in their own Protocols and refer here): with
    ``i`` and ``j`` the positions of a query and a key in their row, the query attends to the key
    if and only if

    - ``causal``: ``j <= i``;
    - ``sliding_window=w``: ``|i - j| < w``, so with ``causal`` the last ``w`` tokens
      (``i - w < j <= i``), without it ``w - 1`` tokens on each side (FlashAttention's
      ``window_size=(w - 1, w - 1)``);
    - ``document_ids``: ``document_ids[b, i] == document_ids[b, j]``.

    Conditions combine with "and"; absent ones allow everything. Positions are those of the whole
    row, whoever holds which part of it (context parallelism masks by global positions). Every
    query sees at least itself, so no row is fully masked.
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
            causal: Query ``i`` attends only to keys ``j <= i``.
            softmax_scale: Multiplier of the scores before the softmax.
            sliding_window: ``w > 0``: query ``i`` attends only to keys with ``|i - j| < w``.
            document_ids: ``(batch, seq)`` integer ids; a query attends only to keys of its id.

        Returns:
            ``(batch, seq, q_heads, head_dim)`` in ``query.dtype``.
        """
        ...
