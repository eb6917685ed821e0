"""Continuous batching over the paged KV cache: admission, block accounting, preemption, seeds."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError
from rl_tiny_model import tiny_model

from d9d.rl import BlockPool, EmbeddedEngineConfig, EmbeddedRolloutEngine, SamplingParams
from d9d.rl._scheduler import ContinuousScheduler

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 6], [11, 12], [1, 2, 3, 4, 5], [7]]
STOP = 0


def _drive(
    scheduler: ContinuousScheduler, pool: BlockPool, lengths: list[int], config: EmbeddedEngineConfig
) -> list[list[int]]:
    """Runs the scheduler with a fake model: row ``i`` samples ``STOP`` at completion length
    ``lengths[i]``; checks the block accounting at every step; returns the running rows per step."""
    steps: list[list[int]] = []
    while not scheduler.done:
        running = scheduler.schedule()
        assert len(running) <= config.max_rows
        held = [block for row in running for block in row.blocks]
        assert len(held) == len(set(held)) == pool.num_blocks - pool.free_count  # no block shared or lost
        for row in running:
            assert len(row.blocks) == config.blocks_for(len(row.tokens))  # memory follows the tokens
        steps.append([row.index for row in running])
        tokens = [STOP if row.completion_length + 1 == lengths[row.index] else 1 for row in running]
        scheduler.record(running, tokens, [0.0] * len(running))
    return steps


FOUR_ROWS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
FOUR_LENGTHS = [2, 7, 3, 1]


def _two_slots(admission_wait_steps: int) -> tuple[list[list[int]], ContinuousScheduler, BlockPool]:
    """``FOUR_ROWS`` on two slots, each sampling ``STOP`` at its ``FOUR_LENGTHS``: the steps, the
    scheduler and its pool after the run."""
    config = EmbeddedEngineConfig(
        max_rows=2, page_size=2, max_context=64, admission_wait_steps=admission_wait_steps
    )
    pool = BlockPool(16)
    scheduler = ContinuousScheduler(
        FOUR_ROWS, config=config, pool=pool, max_tokens=[8] * len(FOUR_ROWS), stop_token_ids=(STOP,)
    )
    return _drive(scheduler, pool, FOUR_LENGTHS, config), scheduler, pool


def test_rows_finish_independently_and_waiting_prompts_take_their_slots() -> None:
    steps, scheduler, pool = _two_slots(admission_wait_steps=0)
    # row 0 finishes after 2 tokens and row 2 joins while row 1 keeps decoding; row 3 takes row 2's slot
    assert steps == [[0, 1], [0, 1], [1, 2], [1, 2], [1, 2], [1, 3], [1]]
    assert {row.index: row.completion_length for row in scheduler.finished} == dict(enumerate(FOUR_LENGTHS))
    assert all(row.finish_reason == "stop" for row in scheduler.finished)
    assert pool.free_count == pool.num_blocks


def test_freed_slots_wait_for_company_up_to_admission_wait_steps() -> None:
    steps, scheduler, pool = _two_slots(admission_wait_steps=2)
    # row 0's slot frees after forward 2 and stays empty for two forwards (rows 2 and 3 wait, one
    # slot); row 2 finishes with row 1, and the last prompt fits at once
    assert steps == [[0, 1], [0, 1], [1], [1], [1, 2], [1, 2], [1, 2], [3]]
    assert {row.index: row.completion_length for row in scheduler.finished} == dict(enumerate(FOUR_LENGTHS))
    assert pool.free_count == pool.num_blocks


def test_no_block_leaks_over_many_requests_with_preemption() -> None:
    rng = random.Random(0)
    config = EmbeddedEngineConfig(max_rows=5, page_size=3, max_context=40, num_blocks=20)
    pool = BlockPool(20)  # less than 5 rows at their longest: rows get preempted
    rows = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 12))] for _ in range(120)]
    lengths = [rng.randrange(1, 30) for _ in rows]
    scheduler = ContinuousScheduler(
        rows, config=config, pool=pool, max_tokens=[25] * len(rows), stop_token_ids=(STOP,)
    )
    _drive(scheduler, pool, lengths, config)
    assert scheduler.preemptions > 0
    assert pool.free_count == pool.num_blocks and pool.peak_taken <= pool.num_blocks
    for row in scheduler.finished:
        expected = min(lengths[row.index], 25, config.max_context - row.prompt_length)
        assert row.completion_length == expected
        assert row.finish_reason == ("stop" if expected == lengths[row.index] else "length")
        assert row.tokens[: row.prompt_length] == rows[row.index]


def test_block_pool_refuses_double_frees_and_overdraws() -> None:
    pool = BlockPool(3)
    blocks = pool.take(2)
    with pytest.raises(RuntimeError, match="1 free blocks, 2 were asked for"):
        pool.take(2)
    pool.give_back(blocks)
    with pytest.raises(ValueError, match=f"block {blocks[0]} is not taken"):
        pool.give_back(blocks[:1])


def _uncached_greedy(prompt: list[int], tokens: int) -> tuple[int, ...]:
    model = tiny_model()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model.logits(torch.tensor([ids]))[0, -1].argmax()))
    return tuple(ids[len(prompt) :])


def test_greedy_with_few_rows_small_pages_and_preemption_equals_the_uncached_model() -> None:
    config = EmbeddedEngineConfig(max_rows=3, page_size=2, max_context=32, num_blocks=16)
    engine = EmbeddedRolloutEngine(tiny_model(), config=config)
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=9, temperature=0.0))
    stats = engine.last_stats
    assert stats is not None and stats.preemptions > 0 and stats.admissions > len(PROMPTS)
    assert stats.free_blocks_after == stats.pool_blocks == 16
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        assert completion.token_ids == _uncached_greedy(prompt, 9)


def test_seeded_sampling_does_not_depend_on_admission_order() -> None:
    sampling = SamplingParams(max_tokens=7, samples_per_prompt=2, seed=11)
    results = []
    for config in (
        EmbeddedEngineConfig(),
        EmbeddedEngineConfig(max_rows=1, page_size=1),
        EmbeddedEngineConfig(max_rows=4, page_size=3, max_context=16, num_blocks=8),  # preempts
    ):
        results.append(EmbeddedRolloutEngine(tiny_model(), config=config).generate(PROMPTS, sampling))
    for other in results[1:]:
        assert [c.token_ids for c in other] == [c.token_ids for c in results[0]]
        for a, b in zip(other, results[0], strict=True):
            torch.testing.assert_close(a.log_probs, b.log_probs, atol=2e-5, rtol=1e-5)
    assert len({c.token_ids for c in results[0]}) > 1


def test_waiting_for_company_prefills_less_often_and_changes_no_completion() -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 30) for _ in range(rng.randrange(1, 9))] for _ in range(24)]
    caps = [rng.randrange(1, 14) for _ in prompts]
    sampling = SamplingParams(max_tokens=14, seed=5)
    runs = []
    for wait in (0, 6):
        config = EmbeddedEngineConfig(max_rows=6, page_size=4, max_context=32, admission_wait_steps=wait)
        engine = EmbeddedRolloutEngine(tiny_model(), config=config)
        completions = engine.generate_capped(prompts, sampling, caps)
        assert engine.last_stats is not None
        runs.append((completions, engine.last_stats))
    (eager, eager_stats), (batched, batched_stats) = runs
    assert [c.token_ids for c in batched] == [c.token_ids for c in eager]
    for a, b in zip(batched, eager, strict=True):
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=2e-5, rtol=1e-5)
    assert batched_stats.admissions == eager_stats.admissions == len(prompts)
    prefills = [stats.forwards - stats.decode_steps for stats in (eager_stats, batched_stats)]
    assert prefills[1] < prefills[0]
    # the steps while a slot waits still run ahead of the host
    assert batched_stats.decode_ahead_steps > eager_stats.decode_ahead_steps


def test_completions_end_at_the_context() -> None:
    engine = EmbeddedRolloutEngine(tiny_model(), config=EmbeddedEngineConfig(max_context=8, page_size=4))
    completions = engine.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0))
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        assert len(prompt) + len(completion.token_ids) == 8 and completion.finish_reason == "length"
        assert completion.token_ids == _uncached_greedy(prompt, 8 - len(prompt))


def test_bad_input_is_refused_before_generation() -> None:
    with pytest.raises(ValidationError, match="num_blocks=3 cannot hold one row of max_context=64"):
        EmbeddedEngineConfig(max_context=64, page_size=16, num_blocks=3)
    with pytest.raises(ValidationError, match="page_size"):
        EmbeddedEngineConfig(page_size=0)
    with pytest.raises(ValidationError, match="max_rows"):
        EmbeddedEngineConfig(max_rows=0)
    with pytest.raises(ValidationError, match="admission_wait_steps"):
        EmbeddedEngineConfig(admission_wait_steps=-1)
    with pytest.raises(ValidationError, match="compile_backend"):
        EmbeddedEngineConfig.model_validate({"compile_backend": "eager_inductor"})
    engine = EmbeddedRolloutEngine(tiny_model(), config=EmbeddedEngineConfig(max_context=5))
    with pytest.raises(ValueError, match=r"prompt 2 has 7 tokens, longer than .* max_context=5"):
        engine.generate(PROMPTS, SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    assert engine.last_stats is None


def test_capped_rows_finish_at_their_own_length() -> None:
    engine = EmbeddedRolloutEngine(tiny_model(), config=EmbeddedEngineConfig(max_rows=2, page_size=2))
    caps = [1, 6, 2, 4, 3, 5]
    completions = engine.generate_capped(PROMPTS, SamplingParams(temperature=0.0), caps)
    for prompt, cap, completion in zip(PROMPTS, caps, completions, strict=True):
        assert completion.token_ids == _uncached_greedy(prompt, cap) and completion.finish_reason == "length"
    with pytest.raises(ValueError, match="prompt 1: max_tokens=0 must be positive"):
        engine.generate_capped(PROMPTS[:2], SamplingParams(), [3, 0])
    with pytest.raises(ValueError, match="1 completion caps for 2 prompts"):
        engine.generate_capped(PROMPTS[:2], SamplingParams(), [3])
