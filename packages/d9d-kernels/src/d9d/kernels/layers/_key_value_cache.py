"""The key/value cache slot of an attention layer, for incremental decoding."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from d9d.kernels._qk_norm_rope import QKNormRope
from d9d.kernels.layers._attention_sinks import sdpa_with_sinks


class KeyValueCache(Protocol):
    """One attention layer's cache of keys and values, as ``GroupedQueryAttention`` uses it.

    The owner (a generation loop) keeps the slots, the positions and which slots hold real
    tokens; the layer hands over the keys and values of the tokens it is computing and attends
    to everything cached so far.
    """

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new tokens' rotated keys and values, ``(batch, new, kv_heads, head_dim)``.

        Returns:
            Every cached key and value up to and including the new ones, ``(batch, total,
            kv_heads, head_dim)``.
        """
        ...

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``(batch, 1, new, total)`` bool: which cached keys each new query may see."""
        ...


@runtime_checkable
class AttendingKeyValueCache(KeyValueCache, Protocol):
    """A ``KeyValueCache`` that also runs the attention itself, e.g. straight from a paged pool.

    ``attend_cached`` hands such a cache the new queries, keys and values instead of gathering
    ``append``'s keys and masking with ``attention_mask``; a plain ``KeyValueCache`` keeps the
    gather-and-SDPA path.
    """

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        softmax_scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Stores the new keys and values and attends the new queries to everything cached.

        Args:
            query: ``(batch, new, q_heads, head_dim)``, rotated.
            key: ``(batch, new, kv_heads, head_dim)``, rotated.
            value: ``(batch, new, kv_heads, value_dim)``.
            softmax_scale: Score multiplier.
            sliding_window: The layer's window, by position; None for none.
            sinks: ``(q_heads,)`` attention-sink logits; None for none.

        Returns:
            ``(batch, new, q_heads, value_dim)``.
        """
        ...


@runtime_checkable
class NormalizingKeyValueCache(AttendingKeyValueCache, Protocol):
    """An ``AttendingKeyValueCache`` that can also apply the per-head q/k norms and the rotation in
    its attention (a paged pool: ``paged_decode_attention(qk_norm_rope=...)``, one launch fewer per
    layer than ``qk_norm_rope`` before it)."""

    @property
    def takes_qk_norm_rope(self) -> bool:
        """Whether ``attend_cached`` hands this cache the unnormalized queries and keys."""
        ...

    def attend_normalizing(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        qk_norm_rope: QKNormRope,
        *,
        softmax_scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """``attend`` of ``qk_norm_rope.apply(query, key)`` and ``value``, with the norms and the
        rotation inside the attention.

        Args:
            query: ``(batch, new, q_heads, head_dim)``, projected, not yet normalized or rotated.
            key: ``(batch, new, kv_heads, head_dim)``, likewise.
            value: ``(batch, new, kv_heads, value_dim)``.
            qk_norm_rope: The norms' weights and the rotation (``cos`` and ``sin`` ``(batch, new,
                head_dim)``).
            softmax_scale: Score multiplier.
            sliding_window: The layer's window, by position; None for none.
            sinks: ``(q_heads,)`` attention-sink logits; None for none.

        Returns:
            ``(batch, new, q_heads, value_dim)``.
        """
        ...


def attend_cached(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: KeyValueCache,
    *,
    softmax_scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    qk_norm_rope: QKNormRope | None = None,
) -> torch.Tensor:
    """Attention of the new queries to the cache after appending ``key`` and ``value``.

    An ``AttendingKeyValueCache`` runs it itself (``cache.attend``); any other cache gives its
    keys and values so far and its mask to SDPA. With ``qk_norm_rope``, a
    ``NormalizingKeyValueCache`` that ``takes_qk_norm_rope`` gets the unnormalized queries and keys
    (``cache.attend_normalizing``); for any other cache ``qk_norm_rope.apply`` runs first.

    Args:
        query: ``(batch, new, q_heads, head_dim)``, rotated.
        key: ``(batch, new, kv_heads, head_dim)``, rotated.
        value: ``(batch, new, kv_heads, head_dim)``.
        cache: The layer's cache.
        softmax_scale: Score multiplier.
        sliding_window: The layer's window (the cache's mask applies it by position).
        sinks: ``(q_heads,)`` attention-sink logits (``sdpa_with_sinks``); None for none.
        qk_norm_rope: The per-head norms and rotation still to apply to ``query`` and ``key`` (then
            both are projected only); None: both are final.

    Returns:
        ``(batch, new, q_heads, head_dim)``.
    """
    if qk_norm_rope is not None:
        # the flag first: a Protocol isinstance costs microseconds of host time per layer and step
        if getattr(cache, "takes_qk_norm_rope", False) and isinstance(cache, NormalizingKeyValueCache):
            return cache.attend_normalizing(
                query,
                key,
                value,
                qk_norm_rope,
                softmax_scale=softmax_scale,
                sliding_window=sliding_window,
                sinks=sinks,
            )
        query, key = qk_norm_rope.apply(query, key)
    if isinstance(cache, AttendingKeyValueCache):
        return cache.attend(
            query, key, value, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks
        )
    keys, values = cache.append(key, value)
    if sinks is not None:
        out = sdpa_with_sinks(
            query.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            cache.attention_mask(sliding_window),
            sinks,
            softmax_scale=softmax_scale,
        )
        return out.transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=cache.attention_mask(sliding_window),
        scale=softmax_scale,
        enable_gqa=query.shape[2] != key.shape[2],
    )
    return out.transpose(1, 2)
