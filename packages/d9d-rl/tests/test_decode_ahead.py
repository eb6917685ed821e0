"""Launching the next decode step before the host reads this one's tokens (``decode_ahead``)."""

from __future__ import annotations

import random

import pytest
import torch
from rl_tiny_model import tiny_model

from d9d.rl import BlockPool, EmbeddedEngineConfig, EmbeddedRolloutEngine, SamplingParams
from d9d.rl._decode_slots import DecodeSlots
from d9d.rl._decode_step import StaticDecodeStep
from d9d.rl._kv_cache import PagedKVCache
from d9d.rl._scheduler import PENDING_TOKEN, ContinuousScheduler, SequenceState

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 6], [11, 12], [1, 2, 3, 4, 5], [7], [2, 2], [13]]
STOP = 0


def _fake_token(row: SequenceState, stops_at: list[int]) -> int:
    """Row ``i`` samples ``STOP`` as its ``stops_at[i]``-th token, else its completion length + 1."""
    return STOP if row.completion_length + 1 == stops_at[row.index] else row.completion_length + 1


def _run(
    rows: list[list[int]], stops_at: list[int], config: EmbeddedEngineConfig, *, ahead: bool
) -> tuple[ContinuousScheduler, BlockPool, int]:
    """Drives the scheduler the way the engine does, with a fake model; returns it, its pool and the
    count of steps scheduled before the previous step was resolved."""
    pool = BlockPool(config.num_blocks or 64)
    scheduler = ContinuousScheduler(
        rows, config=config, pool=pool, max_tokens=[9] * len(rows), stop_token_ids=(STOP,)
    )
    launched: tuple[list[SequenceState], list[int], list[int]] | None = None
    early = 0
    while True:
        if launched is not None and not (ahead and scheduler.can_decode_ahead()):
            scheduler.resolve(launched[0], launched[1], launched[2], [0.5] * len(launched[0]))
            launched = None
        if scheduler.done:
            break
        running = scheduler.schedule()
        held = [block for row in running for block in row.blocks]
        assert len(held) == len(set(held))
        for row in running:
            assert len(row.blocks) == config.blocks_for(len(row.tokens))
            if launched is not None:  # a step scheduled ahead only decodes rows of the launched step
                assert row.tokens[-1] == PENDING_TOKEN and len(row.tokens) - row.cached == 1
        # the fake model's token depends only on the row's length, as a real step's does on its inputs
        tokens = [_fake_token(row, stops_at) for row in running]
        positions = scheduler.record_launched(running)
        if launched is not None:
            early += 1
            scheduler.resolve(launched[0], launched[1], launched[2], [0.5] * len(launched[0]))
        launched = (running, positions, tokens)
    return scheduler, pool, early


@pytest.mark.parametrize("num_blocks", [None, 12], ids=["roomy", "preempting"])
def test_scheduling_ahead_finishes_every_row_as_the_synchronous_loop_does(num_blocks: int | None) -> None:
    rng = random.Random(3)
    rows = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 6))] for _ in range(40)]
    stops_at = [rng.randrange(1, 14) for _ in rows]  # past 9: the row ends by length
    config = EmbeddedEngineConfig(max_rows=4, page_size=2, max_context=16, num_blocks=num_blocks)
    synchronous, _, none_early = _run(rows, stops_at, config, ahead=False)
    ahead, pool, early = _run(rows, stops_at, config, ahead=True)
    assert none_early == 0 and early > 0
    assert pool.free_count == pool.num_blocks
    by_index = {row.index: row for row in synchronous.finished}
    assert len(ahead.finished) == len(rows)
    for row in ahead.finished:
        expected = by_index[row.index]
        assert (row.tokens, row.finish_reason) == (expected.tokens, expected.finish_reason)
        assert row.log_probs == [0.5] * row.completion_length and PENDING_TOKEN not in row.tokens


def test_a_stop_token_drops_the_step_launched_after_it() -> None:
    config = EmbeddedEngineConfig(max_rows=2, page_size=4, max_context=32)
    pool = BlockPool(8)
    scheduler = ContinuousScheduler(
        [[1], [2]], config=config, pool=pool, max_tokens=[5, 2], stop_token_ids=(STOP,)
    )
    running = scheduler.schedule()
    first = scheduler.record_launched(running)
    assert scheduler.can_decode_ahead()
    ahead = scheduler.schedule()
    second = scheduler.record_launched(ahead)  # row 1 reaches its cap of 2: it finishes by length
    assert [row.tokens for row in running] == [
        [1, PENDING_TOKEN, PENDING_TOKEN],
        [2, PENDING_TOKEN, PENDING_TOKEN],
    ]
    assert [row.finish_reason for row in running] == [None, "length"]
    scheduler.resolve(running, first, [STOP, STOP], [-1.0, -2.0])  # both sampled a stop first
    assert [(row.tokens, row.log_probs, row.finish_reason) for row in running] == [
        ([1, STOP], [-1.0], "stop"),
        ([2, STOP], [-2.0], "stop"),
    ]
    scheduler.resolve(ahead, second, [5, 6], [-3.0, -4.0])  # the later step's tokens are discarded
    assert [row.tokens for row in running] == [[1, STOP], [2, STOP]]
    assert scheduler.done and pool.free_count == pool.num_blocks


def test_a_fed_row_takes_the_previous_steps_token_on_the_device() -> None:
    model = tiny_model()
    cache = PagedKVCache.empty(model, num_blocks=8, page_size=2, device=torch.device("cpu"))
    step = StaticDecodeStep(model, cache, max_rows=4, max_blocks=3)
    slots = DecodeSlots(4, pad_token_id=0)
    rows = [
        SequenceState(
            index=4, prompt_length=2, max_tokens=4, tokens=[3, 7, PENDING_TOKEN], cached=2, blocks=[0, 1]
        ),
        SequenceState(index=9, prompt_length=1, max_tokens=4, tokens=[5, 8], cached=1, blocks=[2]),
    ]
    update = slots.plan(rows, {4: 1})
    assert update.rows == 2 and update.sources == [1, -1]
    step.load(update, torch.tensor([40, 41, 42]))
    assert step.input_ids[:2].tolist() == [41, 8] and step.lengths[:2].tolist() == [3, 2]
    with pytest.raises(RuntimeError, match="row 4's new token is on the device and no step feeds it"):
        slots.plan(rows)
    with pytest.raises(ValueError, match="device-fed rows needs the tokens that feed them"):
        step.load(update)


def _stop_token(prompts: list[list[int]]) -> int:
    """A token the tiny model's greedy completions sample mid-way, so rows stop at different steps."""
    engine = EmbeddedRolloutEngine(tiny_model(), config=EmbeddedEngineConfig(decode_ahead=False))
    completions = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    counts: dict[int, int] = {}
    for completion in completions:
        for token in set(completion.token_ids[1:-1]):
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=lambda token: counts[token])


@pytest.mark.parametrize(
    "config",
    [
        EmbeddedEngineConfig(max_rows=8, page_size=4, max_context=64),
        EmbeddedEngineConfig(max_rows=3, page_size=2, max_context=20, num_blocks=14),  # waves and preemption
    ],
    ids=["one-wave", "waves-preempting"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_completions_do_not_change_with_decode_ahead(
    config: EmbeddedEngineConfig, temperature: float
) -> None:
    sampling = SamplingParams(
        max_tokens=12,
        temperature=temperature,
        samples_per_prompt=2,
        seed=5,
        stop_token_ids=(_stop_token(PROMPTS),),
    )
    results = []
    for ahead in (False, True):
        engine = EmbeddedRolloutEngine(tiny_model(), config=config.model_copy(update={"decode_ahead": ahead}))
        completions = engine.generate(PROMPTS, sampling)
        stats = engine.last_stats
        assert stats is not None and stats.free_blocks_after == stats.pool_blocks
        assert (stats.decode_ahead_steps > 0) == ahead
        results.append(completions)
    synchronous, ahead = results
    assert {c.finish_reason for c in synchronous} == {"stop", "length"}
    for a, b in zip(ahead, synchronous, strict=True):
        assert (a.prompt_index, a.token_ids, a.finish_reason) == (
            b.prompt_index,
            b.token_ids,
            b.finish_reason,
        )
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_steps_launched_ahead_decode_as_the_synchronous_loop(graphs: bool) -> None:
    """On CUDA the next step really is queued before the host reads the tokens: the fed tokens, the
    pinned copies and the events must keep every row's completion as without it."""
    sampling = SamplingParams(
        max_tokens=12, temperature=1.0, samples_per_prompt=3, seed=2, stop_token_ids=(_stop_token(PROMPTS),)
    )
    results = []
    for ahead in (False, True):
        config = EmbeddedEngineConfig(
            max_rows=5, page_size=2, max_context=24, cuda_graphs=graphs, decode_ahead=ahead
        )
        engine = EmbeddedRolloutEngine(tiny_model().cuda(), config=config)
        results.append(engine.generate(PROMPTS, sampling))
        stats = engine.last_stats
        assert stats is not None and (stats.decode_ahead_steps > 0) == ahead
    for a, b in zip(*results, strict=True):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=1e-5)
