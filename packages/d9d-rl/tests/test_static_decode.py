"""The static decode step (device buffers, paged attention in place, CUDA graphs on the GPU)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
import transformers
from rl_tiny_model import VOCAB, tiny_config, tiny_model

from d9d.hf import DecoderCausalLM
from d9d.kernels.layers import sdpa_with_sinks
from d9d.rl import EmbeddedEngineConfig, EmbeddedRolloutEngine, SamplingParams
from d9d.rl._decode_runtime import _DeviceTimer  # pyright: ignore[reportPrivateUsage]
from d9d.rl._decode_slots import DecodeSlots, bucket_for
from d9d.rl._decode_step import DecodeAttention, DecodeLayerView, StaticDecodeStep
from d9d.rl._kv_cache import PagedBatch, PagedKVCache, forward_paged
from d9d.rl._scheduler import SequenceState

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 6], [11, 12], [1, 2, 3, 4, 5], [7, 7]]


def _sequence(index: int, tokens: list[int], blocks: list[int]) -> SequenceState:
    return SequenceState(
        index=index,
        prompt_length=len(tokens) - 1,
        max_tokens=8,
        tokens=tokens,
        cached=len(tokens) - 1,
        blocks=blocks,
    )


@pytest.mark.parametrize(
    "attention",
    [
        DecodeAttention(),
        DecodeAttention(fused_pool_write=True),
        DecodeAttention(fused_pool_write=True, longest_rows_first=True),
        DecodeAttention(fused_pool_write=True, fused_qk_norm_rope=True),
    ],
    ids=["index-copy", "fused-write", "fused-write-longest-first", "fused-write-qk-norm-rope"],
)
def test_static_step_equals_the_gathering_path(attention: DecodeAttention) -> None:
    """One decode step of ragged rows (in buffer rows 3, 1, 0; row 2 idle) against ``forward_paged``;
    the pool written by ``index_copy_`` or by the attention op, whose rows may start longest first
    and which may apply the q/k norms and rotation itself."""
    model = tiny_model()  # layer 1 has a window of 4 positions: the longest row sees past it
    with torch.no_grad():  # norms that are not all ones, so that their weights are checked too
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 1.5)
    caches = [
        PagedKVCache.empty(model, num_blocks=12, page_size=2, device=torch.device("cpu")) for _ in range(2)
    ]
    sequences = [
        _sequence(5, [3, 7, 1, 9, 2, 4, 4, 8], [4, 0, 7, 1]),
        _sequence(6, [5, 6], [2]),
        _sequence(7, [11, 12, 13, 14, 15], [9, 3, 11]),
    ]
    prompts = PagedBatch(
        tokens=[s.tokens[:-1] for s in sequences], starts=[0] * 3, blocks=[s.blocks for s in sequences]
    )
    news = PagedBatch(
        tokens=[s.tokens[-1:] for s in sequences], starts=[s.cached for s in sequences], blocks=prompts.blocks
    )
    step = StaticDecodeStep(
        model,
        caches[0],
        max_rows=4,
        max_blocks=6,
        attention=attention,
    )
    slots = DecodeSlots(4, pad_token_id=0)
    # a step before: two rows that then finish and two that stay in their buffer rows
    step.load(slots.plan([_sequence(0, [1], [8]), sequences[0], _sequence(1, [1], [10]), sequences[2]]))
    with torch.no_grad():
        for cache in caches:
            forward_paged(model, cache, prompts, pad_token_id=0)
        expected = forward_paged(model, caches[1], news, pad_token_id=0)
        update = slots.plan([sequences[2], sequences[0], sequences[1]])
        order = step.load(update)
        logits = step.forward(update.rows)[order.long()]
    assert update.rows == 4 and update.order == [3, 1, 0] and update.lengths[2] == 0
    torch.testing.assert_close(logits, expected[[2, 0, 1]], atol=1e-5, rtol=1e-5)
    used = [block * 2 + offset for s in sequences for block in s.blocks for offset in range(2)]
    for mine, theirs in zip(
        caches[0].keys + caches[0].values, caches[1].keys + caches[1].values, strict=True
    ):
        torch.testing.assert_close(mine[used], theirs[used], atol=1e-6, rtol=1e-6)


def test_rows_keep_their_buffer_row_and_only_new_blocks_are_sent() -> None:
    slots = DecodeSlots(8, pad_token_id=0)
    rows = [_sequence(i, [1] * (i + 2), [10 + i]) for i in range(5)]
    first = slots.plan(rows)
    assert (first.rows, first.order, first.lengths) == (8, [0, 1, 2, 3, 4], [2, 3, 4, 5, 6, 0, 0, 0])
    assert first.table_blocks == [10, 11, 12, 13, 14] and first.table_columns == [0] * 5
    rows[4].blocks.append(20)
    second = slots.plan(rows[2:])  # rows 0 and 1 finished: 3 rows fit a bucket of 4
    assert second.rows == bucket_for(3, 8) == 4
    assert second.order == [2, 3, 0]  # row 4 moves into the bucket, sending its whole table
    assert (second.table_rows, second.table_columns, second.table_blocks) == ([0, 0], [0, 1], [14, 20])
    assert second.lengths == [6, 0, 4, 5]


@pytest.mark.parametrize("fused_write", [False, True], ids=["index-copy", "fused-write"])
@pytest.mark.parametrize(("window", "sinks"), [(None, False), (3, False), (None, True)])
def test_paged_attention_equals_sdpa_over_the_gathered_view(
    window: int | None, sinks: bool, fused_write: bool
) -> None:
    torch.manual_seed(0)
    keys, values = torch.randn(2, 24, 2, 8).unbind(0)
    table = torch.tensor([[3, 1, 5], [0, 0, 0], [2, 4, 0]], dtype=torch.int32)
    lengths = torch.tensor([9, 0, 5], dtype=torch.int32)
    view = DecodeLayerView(
        keys=keys,
        values=values,
        page_size=4,
        write_slots=torch.tensor([5 * 4 + 0, 0, 4 * 4 + 0]),  # at position length - 1; idle: a free block
        block_table=table,
        lengths=lengths,
        attention=DecodeAttention(fused_pool_write=fused_write),
    )
    query, key, value = torch.randn(3, 3, 1, 4, 8).unbind(0)
    key, value = key[:, :, :2], value[:, :, :2]
    sink_logits = torch.tensor([1.0, -2.0, 0.5, 3.0]) if sinks else None
    got = view.attend(query, key, value, softmax_scale=0.3, sliding_window=window, sinks=sink_logits)
    gathered_keys, gathered_values = view.append(key, value)
    mask = view.attention_mask(window)
    q, k, v = query.transpose(1, 2), gathered_keys.transpose(1, 2), gathered_values.transpose(1, 2)
    if sink_logits is not None:
        expected = sdpa_with_sinks(q, k, v, mask, sink_logits, softmax_scale=0.3)
    else:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    expected = expected.transpose(1, 2)
    torch.testing.assert_close(got[[0, 2]], expected[[0, 2]], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # an idle row attends to nothing


def _gathering_path_greedy(model: DecoderCausalLM, prompt: list[int], tokens: int) -> tuple[int, ...]:
    """The engine's former decode: every step through ``forward_paged`` (gather + SDPA), one row."""
    cache = PagedKVCache.empty(model, num_blocks=16, page_size=2, device=torch.device("cpu"))
    ids, cached = list(prompt), 0
    with torch.no_grad():
        for _ in range(tokens):
            batch = PagedBatch(tokens=[ids[cached:]], starts=[cached], blocks=[list(range(16))])
            ids.append(int(forward_paged(model, cache, batch, pad_token_id=0)[0].argmax()))
            cached = len(ids) - 1
    return tuple(ids[len(prompt) :])


def test_greedy_continuous_batching_equals_the_gathering_path_and_transformers() -> None:
    """Two rows at once: rows finish at their own caps and waiting prompts are admitted mid-decode."""
    caps = [5, 2, 7, 3, 6, 4]
    engine = EmbeddedRolloutEngine(
        tiny_model(sliding_window=False), config=EmbeddedEngineConfig(max_rows=2, page_size=2, max_context=32)
    )
    started = time.perf_counter()
    completions = engine.generate_capped(PROMPTS, SamplingParams(temperature=0.0), caps)
    call_seconds = time.perf_counter() - started
    stats = engine.last_stats
    assert stats is not None and stats.admissions == len(PROMPTS) and stats.decode_steps > max(caps)
    assert stats.graph_buckets == ()  # no graphs on the CPU
    # the decode steps' and prefills' own times are disjoint parts of the call
    assert stats.decode_seconds > 0 and stats.prefill_seconds > 0
    assert stats.decode_seconds + stats.prefill_seconds <= call_seconds
    fields = tiny_config(sliding_window=False).model_dump(exclude={"model_type"}, exclude_none=True)
    reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).eval()
    reference.load_state_dict(engine.model.state_dict())
    for prompt, cap, completion in zip(PROMPTS, caps, completions, strict=True):
        assert completion.token_ids == _gathering_path_greedy(engine.model, prompt, cap)
        generated = reference.generate(
            torch.tensor([prompt]), max_new_tokens=cap, min_new_tokens=cap, do_sample=False, pad_token_id=0
        )
        assert completion.token_ids == tuple(generated[0, len(prompt) :].tolist())
    assert all(token < VOCAB for completion in completions for token in completion.token_ids)


def test_cuda_graphs_on_a_cpu_device_are_refused() -> None:
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs a CUDA device; the model is on cpu"):
        EmbeddedRolloutEngine(tiny_model(), config=EmbeddedEngineConfig(cuda_graphs=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "other",
    [
        {"cuda_graphs": False},  # the eager step
        {"cuda_graphs": True, "longest_rows_first": False},  # rows in order, against the graphed sort
        {"cuda_graphs": True, "fused_qk_norm_rope": True},  # the q/k norms inside the attention kernel
    ],
    ids=["eager", "rows-in-order", "fused-qk-norm-rope"],
)
def test_replayed_graphs_decode_as_another_step(other: dict[str, bool]) -> None:
    sampling = SamplingParams(max_tokens=12, temperature=0.0, samples_per_prompt=3)
    results = []
    for switches in ({"cuda_graphs": True}, other):
        config = EmbeddedEngineConfig(max_rows=8, page_size=4, max_context=64, **switches)
        engine = EmbeddedRolloutEngine(tiny_model().cuda(), config=config)
        results.append(engine.generate_capped(PROMPTS, sampling, [12, 3, 9, 5, 12, 1]))
        stats = engine.last_stats
        assert stats is not None and (stats.graph_buckets != ()) == switches["cuda_graphs"]
    assert [c.token_ids for c in results[0]] == [c.token_ids for c in results[1]]
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_timer_reuses_its_event_pairs_after_a_reset() -> None:
    timer = _DeviceTimer(torch.device("cuda"))
    x = torch.randn(512, 512, device="cuda")

    def spans(count: int) -> None:
        nonlocal x
        for _ in range(count):
            timer.start()
            x = torch.tanh(x @ x)
            timer.stop()

    spans(3)
    pool = list(timer._pairs)  # pyright: ignore[reportPrivateUsage]
    assert len(pool) == 3 and timer.seconds() > 0
    timer.reset()
    assert timer.seconds() == 0.0  # the pairs before the reset are not counted
    spans(2)
    assert timer.seconds() > 0
    assert all(a is b for a, b in zip(timer._pairs, pool, strict=True))  # pyright: ignore[reportPrivateUsage]
    timer.reset()
    spans(4)  # one pair past the pool: the three kept, one new
    grown = timer._pairs  # pyright: ignore[reportPrivateUsage]
    assert len(grown) == 4 and all(a is b for a, b in zip(grown, pool, strict=False))
    assert timer.seconds() > 0
