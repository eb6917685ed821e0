"""GroupedQueryAttention's kv_cache slot: token-by-token decoding equals the whole-sequence forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from d9d.kernels.layers import GroupedQueryAttention, RotaryEmbedding


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
