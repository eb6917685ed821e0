"""Paged decode attention: the reference against per-row SDPA on contiguous keys and values.

Each case writes every row's keys and values into shuffled, non-contiguous blocks of one pool and
checks the op against ``scaled_dot_product_attention`` (or ``sdpa_with_sinks``) on the row's own
contiguous slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from d9d.kernels import paged_decode_attention
from d9d.kernels.layers import sdpa_with_sinks


@dataclass(kw_only=True, frozen=True)
class _Case:
    lengths: tuple[int, ...]
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    value_dim: int = 16
    page_size: int = 4
    max_blocks: int = 5
    window: int | None = None
    sinks: bool = False


@dataclass(kw_only=True, frozen=True)
class _Paged:
    query: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    lengths: torch.Tensor
    sinks: torch.Tensor | None


def _paged(case: _Case, dtype: torch.dtype = torch.float32, seed: int = 0) -> _Paged:
    """Random rows scattered into a pool with spare blocks, block ids shuffled across rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(case.lengths)
    num_blocks = rows * case.max_blocks + 3
    order = torch.randperm(num_blocks, generator=gen)
    table = order[: rows * case.max_blocks].view(rows, case.max_blocks).to(torch.int32)
    key_cache = torch.randn(num_blocks * case.page_size, case.kv_heads, case.head_dim, generator=gen)
    value_cache = torch.randn(num_blocks * case.page_size, case.kv_heads, case.value_dim, generator=gen)
    keys, values = [], []
    for row, length in enumerate(case.lengths):
        positions = torch.arange(length)
        slots = table[row, positions // case.page_size].long() * case.page_size + positions % case.page_size
        keys.append(key_cache[slots].to(dtype))
        values.append(value_cache[slots].to(dtype))
    query = torch.randn(rows, case.q_heads, case.head_dim, generator=gen).to(dtype)
    sinks = torch.randn(case.q_heads, generator=gen) if case.sinks else None
    return _Paged(
        query=query,
        keys=keys,
        values=values,
        key_cache=key_cache.to(dtype),
        value_cache=value_cache.to(dtype),
        block_table=table,
        lengths=torch.tensor(case.lengths, dtype=torch.int32),
        sinks=sinks,
    )


def _expected(case: _Case, paged: _Paged, scale: float) -> torch.Tensor:
    """Per row: SDPA of the query over the row's visible contiguous keys (zeros for length 0)."""
    out = torch.zeros(len(case.lengths), case.q_heads, case.value_dim)
    for row, length in enumerate(case.lengths):
        start = 0 if case.window is None else max(0, length - case.window)
        if length == 0:
            continue
        q = paged.query[row].float()[None, :, None]  # (1, q_heads, 1, head_dim)
        k = paged.keys[row][start:].float().transpose(0, 1)[None]  # (1, kv_heads, len, head_dim)
        v = paged.values[row][start:].float().transpose(0, 1)[None]
        if paged.sinks is None:
            attended = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        else:
            allowed = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool)
            attended = sdpa_with_sinks(q, k, v, allowed, paged.sinks, softmax_scale=scale)
        out[row] = attended[0, :, 0]
    return out


def _call(case: _Case, paged: _Paged, scale: float, **kwargs: object) -> torch.Tensor:
    return paged_decode_attention(
        paged.query, paged.key_cache, paged.value_cache, paged.block_table, paged.lengths,
        page_size=case.page_size, softmax_scale=scale, sliding_window=case.window, sinks=paged.sinks,
        **kwargs,  # pyright: ignore[reportArgumentType]
    )  # fmt: skip


CASES = [
    pytest.param(_Case(lengths=(7, 1, 20, 0, 13)), id="mixed-lengths"),  # length 1, a full table, an idle row
    pytest.param(_Case(lengths=(9, 16), q_heads=8, kv_heads=1), id="mqa"),  # one kv head for every query head
    pytest.param(_Case(lengths=(5, 11), q_heads=3, kv_heads=3, value_dim=8), id="mha-narrow-values"),
    pytest.param(_Case(lengths=(6, 18), head_dim=24, value_dim=16), id="mla-like"),  # value_dim < head_dim
    pytest.param(_Case(lengths=(1, 6, 19, 0), window=5), id="sliding-window"),  # windows cut rows 6 and 19
    pytest.param(_Case(lengths=(3, 17, 0), sinks=True), id="sinks"),  # GPT-OSS sink logits
    pytest.param(_Case(lengths=(2, 20, 0), window=3, sinks=True), id="window-and-sinks"),  # GPT-OSS local
    pytest.param(_Case(lengths=(10, 4), page_size=3, max_blocks=4), id="odd-page-size"),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_sdpa_on_contiguous_rows(case: _Case) -> None:
    paged = _paged(case)
    scale = case.head_dim**-0.5
    torch.testing.assert_close(_call(case, paged, scale), _expected(case, paged, scale), rtol=1e-5, atol=1e-5)


def test_reference_ignores_table_entries_past_the_length() -> None:
    # the engine leaves stale or out-of-range block ids past a row's last block
    case = _Case(lengths=(5, 0))
    paged = _paged(case)
    scale = 0.3
    expected = _call(case, paged, scale)
    table = paged.block_table.clone()
    table[0, 2:] = 10_000
    table[1] = -1
    stale = _Paged(**{**paged.__dict__, "block_table": table})
    torch.testing.assert_close(_call(case, stale, scale), expected, rtol=0, atol=0)


def test_bf16_output_keeps_query_dtype() -> None:
    case = _Case(lengths=(8, 3))
    paged = _paged(case, torch.bfloat16)
    out = _call(case, paged, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _expected(case, paged, 0.25), rtol=2e-2, atol=2e-2)


def _bad(paged: _Paged, **changes: torch.Tensor | None) -> _Paged:
    return _Paged(**{**paged.__dict__, **changes})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query": torch.zeros(2, 4)}, "query must be 3-D"),  # no head dim
        ({"query": torch.zeros(2, 3, 16)}, "not a multiple"),  # 3 query heads over 2 kv heads
        ({"query": torch.zeros(2, 4, 8)}, "head_dim"),  # query and keys disagree on head_dim
        ({"value_cache": torch.zeros(4, 2, 16)}, "value_cache shape"),  # another pool size
        ({"block_table": torch.zeros(3, 5, dtype=torch.int32)}, "block_table must be"),  # 3 rows, not 2
        ({"block_table": torch.zeros(2, 5, dtype=torch.int64)}, "block_table must be int32"),
        ({"lengths": torch.zeros(2, dtype=torch.int64)}, "lengths must be int32"),
        ({"lengths": torch.zeros(3, dtype=torch.int32)}, "lengths must be"),
        ({"sinks": torch.zeros(2)}, "sinks must be"),  # one per kv head, not per query head
        ({"query": torch.zeros(2, 4, 16, dtype=torch.bfloat16)}, "share one floating dtype"),
    ],
)
def test_bad_inputs_raise_naming_the_tensor(change: dict[str, torch.Tensor], message: str) -> None:
    case = _Case(lengths=(3, 2))
    with pytest.raises(ValueError, match=message):
        _call(case, _bad(_paged(case), **change), 0.25)


def test_bad_page_size_and_window_raise() -> None:
    case = _Case(lengths=(3, 2))
    paged = _paged(case)
    with pytest.raises(ValueError, match="page_size=3 does not divide"):
        _call(_Case(lengths=(3, 2), page_size=3), paged, 0.25)
    with pytest.raises(ValueError, match="sliding_window=0"):
        _call(_Case(lengths=(3, 2), window=0), paged, 0.25)
