"""GroupedQueryAttention's kv_cache slot: token-by-token decoding equals the whole-sequence forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from d9d.kernels import QKNormRope
from d9d.kernels.layers import (
    AttendingKeyValueCache,
    GroupedQueryAttention,
    NormalizingKeyValueCache,
    RotaryEmbedding,
)


@dataclass(kw_only=True)
class _Cache:
    """The smallest KeyValueCache: one row set, causal by slot, a window by slot distance."""

    keys: list[torch.Tensor] = field(default_factory=list[torch.Tensor])
    values: list[torch.Tensor] = field(default_factory=list[torch.Tensor])
    new: int = 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.append(key)
        self.values.append(value)
        self.new = key.shape[1]
        return torch.cat(self.keys, dim=1), torch.cat(self.values, dim=1)

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        total = sum(k.shape[1] for k in self.keys)
        query = torch.arange(total - self.new, total)[:, None]
        key = torch.arange(total)[None, :]
        allowed = key <= query
        if sliding_window is not None:
            allowed &= query - key < sliding_window
        return allowed[None, None]


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_decoding_with_the_cache_equals_the_whole_sequence(sliding_window: int | None, sinks: bool) -> None:
    torch.manual_seed(0)
    attention = GroupedQueryAttention(
        32, 4, 2, qk_norm=True, sliding_window=sliding_window, sinks=sinks, attention_backend="eager"
    )
    if attention.sinks is not None:
        with torch.no_grad():
            attention.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 4.0]))  # weights that show
    rotary = RotaryEmbedding(8, theta=10_000.0)
    hidden = torch.randn(2, 7, 32)
    positions = torch.arange(7).expand(2, 7)
    cos, sin = rotary(positions, dtype=hidden.dtype)
    with torch.no_grad():
        whole = attention(hidden, (cos, sin))
        cache = _Cache()
        prefill = attention(hidden[:, :4], (cos[:, :4], sin[:, :4]), kv_cache=cache)
        steps = [
            attention(hidden[:, t : t + 1], (cos[:, t : t + 1], sin[:, t : t + 1]), kv_cache=cache)
            for t in range(4, 7)
        ]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), whole, atol=1e-5, rtol=1e-5)


@dataclass(kw_only=True)
class _AttendingCache(_Cache):
    """An ``AttendingKeyValueCache``: attends itself (here, eagerly over what it holds)."""

    calls: list[tuple[float, int | None, bool]] = field(default_factory=list[tuple[float, int | None, bool]])

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
        self.calls.append((softmax_scale, sliding_window, sinks is not None))
        keys, values = self.append(key, value)
        scores = torch.einsum("bqhd,bkhd->bhqk", query, keys.repeat_interleave(2, dim=2)) * softmax_scale
        scores = scores.masked_fill(~self.attention_mask(sliding_window), float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), values.repeat_interleave(2, dim=2))


def _assert_token_by_token_equals_the_whole(
    attention: GroupedQueryAttention, cache: _AttendingCache, *, tokens: int
) -> None:
    """Decoding ``tokens`` random tokens one by one through ``cache`` gives the whole-sequence forward."""
    hidden = torch.randn(2, tokens, 32)
    cos, sin = RotaryEmbedding(8, theta=10_000.0)(torch.arange(tokens).expand(2, tokens), dtype=hidden.dtype)
    with torch.no_grad():
        whole = attention(hidden, (cos, sin))
        steps = [
            attention(hidden[:, t : t + 1], (cos[:, t : t + 1], sin[:, t : t + 1]), kv_cache=cache)
            for t in range(tokens)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_a_cache_that_attends_itself_gets_the_layers_attention() -> None:
    torch.manual_seed(0)
    attention = GroupedQueryAttention(32, 4, 2, sliding_window=3, attention_backend="eager")
    assert isinstance(_AttendingCache(), AttendingKeyValueCache) and not isinstance(
        _Cache(), AttendingKeyValueCache
    )
    cache = _AttendingCache()
    _assert_token_by_token_equals_the_whole(attention, cache, tokens=6)
    assert cache.calls == [(attention.softmax_scale, 3, False)] * 6


@dataclass(kw_only=True)
class _NormalizingCache(_AttendingCache):
    """A ``NormalizingKeyValueCache``: records the q/k norms handed to it, then applies them itself."""

    takes_qk_norm_rope: bool = True
    handed: list[QKNormRope] = field(default_factory=list[QKNormRope])

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
        self.handed.append(qk_norm_rope)
        query, key = qk_norm_rope.apply(query, key)
        return self.attend(
            query, key, value, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks
        )


@pytest.mark.parametrize("takes", [True, False], ids=["takes-the-norms", "declines-them"])
def test_a_cache_that_normalizes_gets_the_projections_and_the_norms(takes: bool) -> None:
    """Per-head q/k norms (Qwen3) go to a cache that takes them with the unnormalized projections; a
    cache that declines them gets the normalized, rotated queries and keys through ``attend``."""
    torch.manual_seed(0)
    attention = GroupedQueryAttention(32, 4, 2, qk_norm=True, attention_backend="eager")
    with torch.no_grad():
        for norm in (attention.q_norm, attention.k_norm):
            assert norm is not None
            norm.weight.uniform_(0.5, 1.5)
    assert isinstance(_NormalizingCache(), NormalizingKeyValueCache)
    assert not isinstance(_AttendingCache(), NormalizingKeyValueCache)
    cache = _NormalizingCache(takes_qk_norm_rope=takes)
    _assert_token_by_token_equals_the_whole(attention, cache, tokens=5)
    assert len(cache.handed) == (5 if takes else 0) and len(cache.calls) == 5
    if takes:
        assert cache.handed[0].q_weight is attention.q_norm.weight  # type: ignore[union-attr]
        assert cache.handed[0].eps == attention.q_norm.eps  # type: ignore[union-attr]
