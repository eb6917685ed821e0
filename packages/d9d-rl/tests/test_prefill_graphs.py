"""One fresh prompt's prefill at a static width (``StaticPrefill``, what ``prefill_graphs`` captures):
the same logits and cached keys and values as ``forward_paged`` on the prompt alone (CPU), and the
engine's completions with the graphs (gpu-marked)."""

from __future__ import annotations

import pytest
import torch
from rl_tiny_model import tiny_model

from d9d.rl import Completion, EmbeddedEngineConfig, EmbeddedRolloutEngine, SamplingParams
from d9d.rl._kv_cache import PagedBatch, PagedKVCache, forward_paged
from d9d.rl._prefill_graphs import GRAPHED_MAX_WIDTH, StaticPrefill, width_bucket

PAGE = 4


def _blocks(first: int, tokens: int) -> list[int]:
    """Block ids for ``tokens`` tokens, every other block from ``first`` (not contiguous)."""
    return [first + 2 * index for index in range(-(-tokens // PAGE))]


def test_width_buckets_are_powers_of_two_from_sixteen() -> None:
    assert [width_bucket(n) for n in (1, 15, 16, 17, 33, 2048)] == [16, 16, 16, 32, 64, 2048]


def test_a_padded_prefill_gives_the_prompts_logits_and_caches_only_its_tokens() -> None:
    """Prompts of several buckets, a short one after a longer one in the same bucket (the buffers'
    older contents must not leak), the sliding-window layer included."""
    model = tiny_model()
    device = torch.device("cpu")
    pools = [PagedKVCache.empty(model, num_blocks=60, page_size=PAGE, device=device) for _ in "ab"]
    static = StaticPrefill(model, pools[1], pad_token_id=0)
    prompts = [
        [5, 3, 9, 1, 1, 7, 2, 8, 4, 4, 6, 2, 9, 3, 1],
        [7, 2, 5],
        [3] * 17,
        [9, 8, 7, 6, 5, 4, 3, 2, 1] * 5,
    ]
    first_block = 0
    with torch.no_grad():
        for prompt in prompts:
            blocks = _blocks(first_block, len(prompt))
            first_block = blocks[-1] + 1
            batch = PagedBatch(tokens=[prompt], starts=[0], blocks=[blocks])
            expected = forward_paged(model, pools[0], batch, pad_token_id=0)
            width = static.load(prompt, blocks)
            assert width == width_bucket(len(prompt))
            torch.testing.assert_close(static.forward(width), expected, atol=1e-5, rtol=1e-5)
    scratch = pools[0].num_blocks * PAGE  # the padding's keys and values went there; nothing else did
    for eager_pool, static_pool in zip(
        pools[0].keys + pools[0].values, pools[1].keys + pools[1].values, strict=True
    ):
        torch.testing.assert_close(static_pool[:scratch], eager_pool[:scratch], atol=1e-5, rtol=1e-5)
        assert static_pool[scratch:].abs().sum() > 0 and eager_pool[scratch:].abs().sum() == 0


def test_a_static_prefill_refuses_what_it_cannot_take() -> None:
    model = tiny_model()
    pool = PagedKVCache.empty(
        model, num_blocks=GRAPHED_MAX_WIDTH // PAGE + 8, page_size=PAGE, device=torch.device("cpu")
    )
    static = StaticPrefill(model, pool, pad_token_id=0)
    with pytest.raises(ValueError, match=f"at most {GRAPHED_MAX_WIDTH} tokens"):
        static.load([1] * (GRAPHED_MAX_WIDTH + 1), list(range(GRAPHED_MAX_WIDTH // PAGE + 1)))
    with pytest.raises(ValueError, match="got 9 tokens and 2 blocks of 4"):
        static.load([1] * 9, [0, 1])


def test_prefill_graphs_without_cuda_graphs_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill_graphs=True needs the decode step in CUDA graphs"):
        EmbeddedRolloutEngine(tiny_model(), config=EmbeddedEngineConfig(prefill_graphs=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_prefills_complete_as_eager_ones_on_cuda() -> None:
    """Single admissions (graphed), the first wave's several prompts (eager), a readmission after
    preemption and a second call replaying the graphs: the same completions as eager prefills."""
    prompts = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 6], [11, 12], [1, 2, 3, 4, 5] * 4, [7, 7]]
    caps = [12, 3, 9, 5, 12, 1]
    sampling = SamplingParams(max_tokens=12, temperature=0.0, samples_per_prompt=2)
    results: list[list[Completion]] = []
    for graphed in (False, True):
        config = EmbeddedEngineConfig(
            max_rows=3,
            page_size=PAGE,
            max_context=36,
            num_blocks=10,
            prefill_graphs=graphed,  # preempts
            few_rows_linear=False,  # no autotuning: the test is about the prefills
        )
        engine = EmbeddedRolloutEngine(tiny_model().cuda(), config=config)
        for _ in range(2):
            results.append(engine.generate_capped(prompts, sampling, caps))
        stats = engine.last_stats
        assert stats is not None and stats.preemptions > 0 and stats.warm_up_seconds == 0.0
    for other in results[1:]:
        assert [c.token_ids for c in other] == [c.token_ids for c in results[0]]
        for a, b in zip(other, results[0], strict=True):
            torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-4, rtol=1e-4)
