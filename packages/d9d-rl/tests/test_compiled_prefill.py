"""Prefills compiled with ``torch.compile`` (``EmbeddedEngineConfig.compile_prefill``) on CPU: the
same completions as eager prefills, two graphs whatever the prompts' lengths."""

from __future__ import annotations

import pytest
import torch
from rl_tiny_model import tiny_model
from torch._dynamo.utils import counters

from d9d.rl import Completion, EmbeddedEngineConfig, EmbeddedRolloutEngine, SamplingParams
from d9d.rl._kv_cache import PagedBatch, PagedKVCache, compile_paged_logits, forward_paged

PROMPTS = [[3, 7, 1], [5, 9], [9, 2, 4, 4, 8, 1, 6], [11, 12], [1, 2, 3, 4, 5], [7, 7, 7, 7]]
CAPS = [5, 2, 7, 3, 6, 4]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _assert_same(compiled: list[Completion], eager: list[Completion]) -> None:
    assert [c.token_ids for c in compiled] == [c.token_ids for c in eager]
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=1e-5)


def test_compiled_prefills_complete_as_eager_ones_in_two_graphs() -> None:
    """Several rows prefilled at once (ragged prompts), then single admissions as rows finish,
    then other prompt lengths, a preempted row's recomputation and the compiled decode step:
    the same tokens and log-probs as eager prefills, and one graph for one row, one for several.
    ``aot_eager`` traces those graphs as Inductor's would be; Inductor's CPU code for the prefill is
    checked by ``test_a_compiled_prefill_fills_the_pool_as_the_eager_one``."""
    torch._dynamo.reset()  # pyright: ignore[reportPrivateUsage]  # the limit counts graphs per process
    eager, compiled = (
        EmbeddedRolloutEngine(
            tiny_model(),
            config=EmbeddedEngineConfig(
                max_rows=3, page_size=2, max_context=40, compile_prefill=on, compile_backend="aot_eager"
            ),
        )
        for on in (False, True)
    )
    greedy = SamplingParams(temperature=0.0)
    before = _graphs()
    _assert_same(
        compiled.generate_capped(PROMPTS, greedy, CAPS), eager.generate_capped(PROMPTS, greedy, CAPS)
    )
    stats = compiled.last_stats
    assert stats is not None and stats.admissions == len(PROMPTS) and stats.decode_steps > 0
    assert _graphs() - before == 2
    longer = [[*prompt, *prompt, 4] for prompt in reversed(PROMPTS)]
    sampled = SamplingParams(max_tokens=9, samples_per_prompt=2, seed=3)
    _assert_same(compiled.generate(longer, sampled), eager.generate(longer, sampled))
    assert _graphs() - before == 2  # every size is dynamic: no recompilation


def test_a_compiled_prefill_fills_the_pool_as_the_eager_one() -> None:
    """Rows with tokens already cached (a later chunk of their sequence) beside fresh ones."""
    model = tiny_model()
    caches = [PagedKVCache.empty(model, num_blocks=12, page_size=2, device=torch.device("cpu")) for _ in "ab"]
    first = PagedBatch(tokens=[[1, 2, 3], [4, 5, 6, 7, 8]], starts=[0, 0], blocks=[[2, 5], [0, 7, 3]])
    later = PagedBatch(
        tokens=[[9, 10, 11, 12], [13, 14], [15, 16, 17]],
        starts=[3, 5, 0],
        blocks=[[2, 5, 1, 4], [0, 7, 3, 9], [6, 8]],
    )
    compiled = compile_paged_logits(max_rows=3, backend="inductor")
    with torch.no_grad():
        results = [
            [
                forward_paged(model, cache, batch, pad_token_id=0, compiled=function)
                for batch in (first, later)
            ]
            for cache, function in zip(caches, (None, compiled), strict=True)
        ]
    for eager_logits, compiled_logits in zip(*results, strict=True):
        torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5)
    for eager_pool, compiled_pool in zip(
        caches[0].keys + caches[0].values, caches[1].keys + caches[1].values, strict=True
    ):
        torch.testing.assert_close(compiled_pool, eager_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("decode", "prefill", "compiles"), [(True, None, True), (True, False, False)])
def test_compile_prefill_follows_compile_decode_unless_set(
    decode: bool, prefill: bool | None, compiles: bool
) -> None:
    config = EmbeddedEngineConfig(compile_decode=decode, compile_prefill=prefill)
    engine = EmbeddedRolloutEngine(tiny_model(), config=config)
    assert (engine._compiled_prefill is not None) == compiles  # pyright: ignore[reportPrivateUsage]


def test_first_compiled_prefills_are_timed_and_logged_once_per_pool(caplog: pytest.LogCaptureFixture) -> None:
    config = EmbeddedEngineConfig(
        max_rows=3, page_size=2, max_context=40, compile_prefill=True, compile_backend="aot_eager"
    )
    engine = EmbeddedRolloutEngine(tiny_model(), config=config)
    greedy = SamplingParams(temperature=0.0)
    with caplog.at_level("INFO", logger="d9d.rl"):
        engine.generate_capped(PROMPTS, greedy, CAPS)  # three rows at once, then single admissions
    first = engine.last_stats
    assert first is not None and first.warm_up_seconds > 0
    messages = [record.getMessage() for record in caplog.records if record.name == "d9d.rl"]
    assert [message.split(" in ")[0] for message in messages] == [
        "engine warm-up: first prefill of several rows",
        "engine warm-up: first prefill of one row",
    ]
    caplog.clear()
    with caplog.at_level("INFO", logger="d9d.rl"):
        engine.generate_capped(PROMPTS, greedy, CAPS)  # the same pool: nothing runs for the first time
    again = engine.last_stats
    assert again is not None and again.warm_up_seconds == 0.0 and not caplog.records
    eager = EmbeddedRolloutEngine(tiny_model(), config=EmbeddedEngineConfig(max_rows=3, max_context=40))
    eager.generate_capped(PROMPTS, greedy, CAPS)
    assert eager.last_stats is not None and eager.last_stats.warm_up_seconds == 0.0
