"""The decode step compiled with ``torch.compile`` (``EmbeddedEngineConfig.compile_decode``): on CPU,
and on CUDA with and without graphs (gpu-marked)."""

from __future__ import annotations

import pytest
import torch
from rl_tiny_model import tiny_model
from torch._dynamo.utils import counters

from d9d.rl import CompileBackend, Completion, EmbeddedEngineConfig, EmbeddedRolloutEngine, SamplingParams

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 6], [11, 12], [1, 2, 3, 4, 5], [7, 7]]
CAPS = [5, 2, 7, 3, 6, 4]


def _graphs() -> int:
    """Graphs Dynamo has compiled in this process."""
    return counters["stats"]["unique_graphs"]


def _engines(
    backend: CompileBackend = "inductor", **config: int | None
) -> tuple[EmbeddedRolloutEngine, EmbeddedRolloutEngine]:
    """An eager and a compiled engine over the same weights (sliding-window layer included); the
    prefills stay eager (``test_compiled_prefill.py`` compiles them). Inductor's CPU code is
    checked once, in the first test; the others check the one graph with ``aot_eager``, which
    traces it the same way in about half the time."""
    eager, compiled = (
        EmbeddedRolloutEngine(
            tiny_model(),
            config=EmbeddedEngineConfig.model_validate(
                config | {"compile_decode": on, "compile_prefill": False, "compile_backend": backend}
            ),
        )
        for on in (False, True)
    )
    return eager, compiled


def _assert_same(compiled: list[Completion], eager: list[Completion], tolerance: float = 1e-5) -> None:
    """The same tokens, log-probs within ``tolerance`` (fused arithmetic rounds differently)."""
    assert [c.token_ids for c in compiled] == [c.token_ids for c in eager]
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=tolerance, rtol=tolerance)


def test_compiled_step_decodes_as_the_eager_one_and_keeps_its_graphs_across_pools() -> None:
    """Rows of buckets 4, 2 and 1 (rows finish at their own caps, waiting prompts are admitted),
    then a larger pool (a longer call) and a pool rebuilt after ``sleep``: two graphs in all."""
    eager, compiled = _engines(max_rows=4, page_size=2, max_context=32)
    greedy = SamplingParams(temperature=0.0)
    before = _graphs()
    _assert_same(
        compiled.generate_capped(PROMPTS, greedy, CAPS), eager.generate_capped(PROMPTS, greedy, CAPS)
    )
    # one row has sizes of its own (a size of 1 is always specialized); 2 and 4 rows share a graph
    assert _graphs() - before == 2
    first = compiled.last_stats
    assert first is not None and first.decode_steps > max(CAPS) and first.graph_buckets == ()
    assert first.warm_up_seconds > 0  # the compiled step's (and prefills') first runs
    sampled = SamplingParams(max_tokens=12, samples_per_prompt=2, seed=5)
    _assert_same(compiled.generate(PROMPTS, sampled), eager.generate(PROMPTS, sampled))
    second = compiled.last_stats
    assert second is not None and second.pool_blocks > first.pool_blocks  # a new, larger pool
    compiled.sleep()
    compiled.wake()
    _assert_same(
        compiled.generate_capped(PROMPTS, greedy, CAPS), eager.generate_capped(PROMPTS, greedy, CAPS)
    )
    assert _graphs() - before == 2  # the pool's size is dynamic: no recompilation


def test_compiled_step_with_preemption_decodes_as_the_eager_one() -> None:
    eager, compiled = _engines("aot_eager", max_rows=3, page_size=2, max_context=32, num_blocks=16)
    greedy = SamplingParams(max_tokens=9, temperature=0.0)
    _assert_same(compiled.generate(PROMPTS, greedy), eager.generate(PROMPTS, greedy))
    stats = compiled.last_stats
    assert stats is not None and stats.preemptions > 0 and stats.admissions > len(PROMPTS)
    assert stats.free_blocks_after == stats.pool_blocks == 16


def test_steps_with_the_qk_norms_in_the_attention_decode_as_the_default_one() -> None:
    """``fused_qk_norm_rope``: eager and compiled, the layers hand the attention op their projections
    and q/k norms (on CPU its reference applies them); the completions are the default engine's."""
    eager, compiled = _engines("aot_eager", max_rows=4, page_size=2, max_context=32, fused_qk_norm_rope=True)
    default = EmbeddedRolloutEngine(
        tiny_model(), config=EmbeddedEngineConfig(max_rows=4, page_size=2, max_context=32)
    )
    greedy = SamplingParams(temperature=0.0)
    expected = default.generate_capped(PROMPTS, greedy, CAPS)
    _assert_same(eager.generate_capped(PROMPTS, greedy, CAPS), expected)
    _assert_same(compiled.generate_capped(PROMPTS, greedy, CAPS), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_step_on_cuda_with_and_without_graphs_decodes_as_the_eager_graphs() -> None:
    """The compiled step (Triton paged attention an opaque op in it) captured per bucket, and run
    without graphs, against the eager step's graphs; the compiled engines' prefills compile too."""
    sampling = SamplingParams(max_tokens=12, temperature=0.0, samples_per_prompt=3)
    caps = [12, 3, 9, 5, 12, 1]
    results: list[list[Completion]] = []
    compiled_graphs = 0
    for graphs, compiled in ((False, False), (True, True), (False, True)):
        config = EmbeddedEngineConfig(
            max_rows=8, page_size=4, max_context=64, cuda_graphs=graphs, compile_decode=compiled
        )
        engine = EmbeddedRolloutEngine(tiny_model().cuda(), config=config)
        before = _graphs()
        results.append(engine.generate_capped(PROMPTS, sampling, caps))
        stats = engine.last_stats
        assert stats is not None and (8 in stats.graph_buckets) == graphs
        # every bucket ran compiled: past the limit (the buckets' count) Dynamo would have raised;
        # the prefills add a graph for one row and one for several
        new_graphs = _graphs() - before
        assert new_graphs <= 4 + 2 and (compiled or new_graphs == 0)
        compiled_graphs += new_graphs
    # torch < 2.15 has no per-region cache: the second compiled engine may reuse the first's graphs
    assert compiled_graphs > 0
    for other in results[1:]:
        _assert_same(other, results[0], tolerance=1e-4)  # Inductor's norms against the Triton kernels
