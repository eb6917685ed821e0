"""Paged decode attention: the reference against per-row SDPA on contiguous keys and values.

Each case writes every row's keys and values into shuffled, non-contiguous blocks of one pool and
checks the op against ``scaled_dot_product_attention`` (or ``sdpa_with_sinks``) on the row's own
contiguous slice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from d9d.kernels import KernelBackend, paged_decode_attention
from d9d.kernels._paged_attention_inputs import PagedDecodeInputs
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
    row_order: torch.Tensor | None = None


def _paged(case: _Case, dtype: torch.dtype = torch.float32, device: str = "cpu") -> _Paged:
    """Random rows scattered into a pool with spare blocks, block ids shuffled across rows."""
    gen = torch.Generator().manual_seed(0)
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
        query=query.to(device),
        keys=keys,
        values=values,
        key_cache=key_cache.to(device, dtype),
        value_cache=value_cache.to(device, dtype),
        block_table=table.to(device),
        lengths=torch.tensor(case.lengths, dtype=torch.int32, device=device),
        sinks=None if sinks is None else sinks.to(device),
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


def _inputs(case: _Case, paged: _Paged, scale: float) -> PagedDecodeInputs:
    return PagedDecodeInputs(
        query=paged.query, key_cache=paged.key_cache, value_cache=paged.value_cache,
        block_table=paged.block_table, lengths=paged.lengths,
        page_size=case.page_size, softmax_scale=scale, sliding_window=case.window, sinks=paged.sinks,
        row_order=paged.row_order,
    )  # fmt: skip


def _call(
    case: _Case, paged: _Paged, scale: float, backend: KernelBackend = KernelBackend.AUTO
) -> torch.Tensor:
    return paged_decode_attention(
        paged.query, paged.key_cache, paged.value_cache, paged.block_table, paged.lengths,
        page_size=case.page_size, softmax_scale=scale, sliding_window=case.window, sinks=paged.sinks,
        row_order=paged.row_order, backend=backend,
    )  # fmt: skip


CASES = [
    pytest.param(_Case(lengths=(7, 1, 20, 0, 13)), id="mixed-lengths"),  # length 1, a full table, an idle row
    pytest.param(_Case(lengths=(9, 16), q_heads=8, kv_heads=1), id="mqa"),  # one kv head for every query head
    pytest.param(
        _Case(lengths=(5, 11), q_heads=3, kv_heads=3, value_dim=8), id="mha-narrow-values"
    ),  # no GQA, value_dim 8
    pytest.param(_Case(lengths=(6, 18), head_dim=24, value_dim=16), id="mla-like"),  # value_dim < head_dim
    pytest.param(_Case(lengths=(1, 6, 19, 0), window=5), id="sliding-window"),  # windows cut rows 6 and 19
    pytest.param(_Case(lengths=(3, 17, 0), sinks=True), id="sinks"),  # GPT-OSS sink logits
    pytest.param(_Case(lengths=(2, 20, 0), window=3, sinks=True), id="window-and-sinks"),  # GPT-OSS local
    pytest.param(_Case(lengths=(10, 4), page_size=3, max_blocks=4), id="odd-page-size"),  # 3-slot pages
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
        ({"row_order": torch.tensor([1, 0])}, "row_order must be int32"),  # int64
        ({"row_order": torch.zeros(3, dtype=torch.int32)}, "row_order must be"),  # 3 rows, not 2
    ],
)
def test_bad_inputs_raise_naming_the_tensor(change: dict[str, torch.Tensor], message: str) -> None:
    case = _Case(lengths=(3, 2))
    with pytest.raises(ValueError, match=message):
        _call(case, _bad(_paged(case), **change), 0.25)


def test_inputs_derive_the_sizes_every_path_reads() -> None:
    # GQA 4 query heads over 2 kv heads, value_dim 8 < head_dim 24, a 5-block table of 3-slot pages
    case = _Case(lengths=(3, 2, 0), head_dim=24, value_dim=8, page_size=3, sinks=True)
    inputs = _inputs(case, _paged(case), 0.25)
    sizes = (inputs.rows, inputs.q_heads, inputs.head_dim, inputs.kv_heads, inputs.value_dim)
    assert sizes == (3, 4, 24, 2, 8)
    assert (inputs.group, inputs.capacity) == (2, 15)
    assert [t.shape for t in inputs.floats] == [(3, 4, 24), (54, 2, 24), (54, 2, 8), (4,)]
    inputs.check()  # fits: no error
    without_sinks = PagedDecodeInputs(**{**inputs.__dict__, "sinks": None})
    assert len(without_sinks.floats) == 3


def test_bad_page_size_and_window_raise() -> None:
    case = _Case(lengths=(3, 2))
    paged = _paged(case)
    with pytest.raises(ValueError, match="page_size=3 does not divide"):
        _call(_Case(lengths=(3, 2), page_size=3), paged, 0.25)
    with pytest.raises(ValueError, match="sliding_window=0"):
        _call(_Case(lengths=(3, 2), window=0), paged, 0.25)


TRITON_CASES = [
    pytest.param(_Case(lengths=(7, 1, 20, 0, 13)), id="mixed-lengths"),  # GQA 4/2, length 1, an idle row
    pytest.param(
        _Case(lengths=(6, 18), head_dim=24, value_dim=8, page_size=3, max_blocks=7), id="mla-odd-page"
    ),  # value_dim < head_dim, neither a power of two; 3-slot pages
    pytest.param(_Case(lengths=(1, 6, 19, 0), window=5, sinks=True), id="window-and-sinks"),  # GPT-OSS
    pytest.param(
        _Case(lengths=(9, 16), q_heads=8, kv_heads=1, sinks=True), id="mqa-sinks"
    ),  # 8 query heads on one kv head
]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "num_splits",
    [
        1,  # one program per (row, kv head) finishes its rows itself
        3,  # several programs per row, merged by the combine kernel (some splits get nothing)
    ],
)
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_kernel_matches_reference_in_interpreter(case: _Case, num_splits: int) -> None:
    from d9d.kernels._triton.paged_attention_op import paged_decode_attention_triton

    paged = _paged(case)
    scale = case.head_dim**-0.5
    inputs = _inputs(case, paged, scale)
    out = paged_decode_attention_triton(inputs, num_splits=num_splits)
    torch.testing.assert_close(out, _call(case, paged, scale), rtol=1e-5, atol=1e-5)
    # the rows' programs started longest first: the same values, in row order
    order = torch.argsort(paged.lengths, descending=True).to(torch.int32)
    ordered = PagedDecodeInputs(**{**inputs.__dict__, "row_order": order})
    assert torch.equal(paged_decode_attention_triton(ordered, num_splits=num_splits), out)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_backend_triton_runs_the_kernel_with_its_own_split_count() -> None:
    # bf16 through the public op: the interpreter upcasts tl.dot's operands, the output stays bf16;
    # two (row, kv head) programs on the interpreter's 2 "SMs" get 2 splits each
    case = _Case(lengths=(11, 0), kv_heads=1)
    paged = _paged(case, torch.bfloat16)
    out = _call(case, paged, 0.25, backend=KernelBackend.TRITON)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _call(case, paged, 0.25), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("rows", "capacity", "splits"),
    [
        (1, 4096, 33),  # one row of 8 kv heads on 132 SMs: 264 programs wanted, 33 per (row, head)
        (1, 128, 2),  # a short table: no split smaller than one 64-position step
        (16, 4096, 4),  # 128 (row, head) pairs fill most of the GPU: the floor of four splits
        (64, 4096, 4),  # a full batch still splits four ways: ragged rows balance over the SMs
    ],
)
def test_split_count_fills_the_gpu_from_static_sizes(rows: int, capacity: int, splits: int) -> None:
    from d9d.kernels._triton.paged_attention_op import splits_for

    assert splits_for(rows * 8, capacity, 64, multiprocessors=132) == splits


def test_rows_started_longest_first_split_three_ways_at_a_full_batch() -> None:
    from d9d.kernels._triton.paged_attention_op import splits_for

    assert splits_for(64 * 8, 4096, 64, multiprocessors=132, ordered=True) == 3
    assert splits_for(8, 4096, 64, multiprocessors=132, ordered=True) == 33  # short batches as before


def _qwen3_8b_decode(rows: int, device: str) -> tuple[_Case, _Paged]:
    """32 query / 8 kv heads of 128, 16-token pages, 2k-token contexts, one idle row, on ``device``."""
    lengths = (*(97 * row % 2048 + 1 for row in range(rows - 1)), 0)
    case = _Case(
        lengths=lengths, q_heads=32, kv_heads=8, head_dim=128, value_dim=128, page_size=16, max_blocks=128
    )
    return case, _paged(case, torch.bfloat16, device=device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "rows",
    [
        2,  # short batch: many splits per row
        64,  # one split per (row, kv head)
    ],
)
def test_triton_kernel_at_qwen3_8b_shapes(rows: int) -> None:
    case, paged = _qwen3_8b_decode(rows, "cuda")
    out = _call(case, paged, 128**-0.5)
    exact = _call(case, paged, 128**-0.5, backend=KernelBackend.REFERENCE)
    torch.testing.assert_close(out.float(), exact.float(), rtol=1e-2, atol=1e-2)
    order = torch.argsort(paged.lengths, descending=True).to(torch.int32)
    ordered = _bad(paged, row_order=order)
    # the default launch splits a full batch three ways once ordered (four in row order), which
    # changes the combine's rounding: held to the reference, and bitwise to row order at equal splits
    torch.testing.assert_close(_call(case, ordered, 128**-0.5).float(), exact.float(), rtol=1e-2, atol=1e-2)
    from d9d.kernels._triton.paged_attention_op import paged_decode_attention_triton

    for splits in (3, 4):
        in_order = paged_decode_attention_triton(_inputs(case, paged, 128**-0.5), num_splits=splits)
        longest_first = paged_decode_attention_triton(_inputs(case, ordered, 128**-0.5), num_splits=splits)
        assert torch.equal(longest_first, in_order), f"{splits} splits"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernel_replays_in_a_cuda_graph_with_new_lengths() -> None:
    case, paged = _qwen3_8b_decode(16, "cuda")
    scale = 128**-0.5
    _call(case, paged, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(case, paged, scale)
    paged.lengths.copy_(torch.flip(paged.lengths, (0,)))
    graph.replay()
    torch.testing.assert_close(out, _call(case, paged, scale), rtol=0, atol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_custom_op_for_torch_compile_equals_eager_path_and_has_a_fake() -> None:
    # torch.compile calls the registered custom op (its fake gives the output's shape when tracing)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from d9d.kernels._triton.paged_attention_op import paged_decode_attention_triton

    case = _Case(lengths=(5, 9), value_dim=8, window=4, sinks=True)
    paged = _paged(case)
    args = (paged.query, paged.key_cache, paged.value_cache, paged.block_table, paged.lengths, paged.sinks)
    custom_op: Any = torch.ops.d9d_kernels.paged_decode_attention
    eager = paged_decode_attention_triton(_inputs(case, paged, 0.25), num_splits=2)
    assert torch.equal(custom_op(*args, None, 4, 0.25, 4, 2, 16), eager)
    order = torch.tensor([1, 0], dtype=torch.int32)
    assert torch.equal(custom_op(*args, order, 4, 0.25, 4, 2, 16), eager)
    with FakeTensorMode() as mode:
        fake = custom_op(*(mode.from_tensor(t) for t in args[:5]), None, None, 4, 0.25, 4, 2, 16)
    assert fake.shape == (2, case.q_heads, 8)


def test_more_rows_than_the_launch_grid_takes_raise_before_any_launch() -> None:
    from d9d.kernels._triton.paged_attention_kernels import paged_decode_attention_kernel

    rows = 65536  # one past CUDA's limit on the grid's z dimension, where the rows are
    inputs = PagedDecodeInputs(
        query=torch.zeros(rows, 1, 16), key_cache=torch.zeros(4, 1, 16), value_cache=torch.zeros(4, 1, 16),
        block_table=torch.zeros(rows, 1, dtype=torch.int32), lengths=torch.zeros(rows, dtype=torch.int32),
        page_size=4, softmax_scale=0.25, sliding_window=None, sinks=None,
    )  # fmt: skip
    with pytest.raises(ValueError, match="65536 rows exceed"):
        paged_decode_attention_kernel(inputs, 1, 16)
