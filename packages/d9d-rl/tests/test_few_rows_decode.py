"""The decode step under d9d-kernels' ``FewRowsLinearMode`` (``EmbeddedEngineConfig.few_rows_linear``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from rl_tiny_model import tiny_model

from d9d.rl import Completion, EmbeddedEngineConfig, EmbeddedRolloutEngine, SamplingParams

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 6], [11, 12], [1, 2, 3, 4, 5], [7, 7]]
CAPS = [5, 2, 7, 3, 6, 4]


@pytest.fixture(autouse=True)
def _own_dynamo_cache() -> Iterator[None]:
    """torch < 2.15 shares Dynamo's cache of the decode step (and its limit of 8 graphs) across the
    process: these tests' engines (switch on and off, two dtypes) start and leave it empty."""
    torch._dynamo.reset()  # pyright: ignore[reportPrivateUsage]
    yield
    torch._dynamo.reset()  # pyright: ignore[reportPrivateUsage]


def _generate(model: torch.nn.Module, **config: object) -> list[Completion]:
    engine = EmbeddedRolloutEngine(model, config=EmbeddedEngineConfig.model_validate(config))
    return engine.generate_capped(PROMPTS, SamplingParams(temperature=0.0), CAPS)


def _assert_same(got: list[Completion], expected: list[Completion], tolerance: float) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=tolerance, rtol=tolerance)


def test_the_switch_defaults_to_cuda_only() -> None:
    assert EmbeddedEngineConfig().few_rows_linear is None
    engine = EmbeddedRolloutEngine(tiny_model(), config=EmbeddedEngineConfig(max_rows=2, max_context=16))
    engine.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0.0))  # CPU: the mode stays off


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_mode_in_the_step_decodes_as_without_it_on_cpu(compiled: bool) -> None:
    """On CPU the mode falls back to F.linear: the same tokens, a launch per linear or grouped, and
    the compiled step traces the mode in its one graph (a failure to trace would raise, naming
    compile_decode). The reference is one eager engine without the mode. Eager, the log-probs are
    bit for bit the same. aot_eager runs the traced (decomposed) ops, which on some CPUs round a
    value differently from the eager kernels: one float32 step (2.4e-7 at -3.6) on an AVX-512
    machine. So the compiled step must give the same tokens and log-probs within 1e-6."""
    # the prefills stay eager: the mode is the decode step's, and a compiled prefill only adds graphs;
    # aot_eager traces the step's one graph as Inductor would (test_compiled_decode.py runs Inductor)
    common = {
        "max_rows": 4,
        "page_size": 2,
        "max_context": 32,
        "compile_prefill": False,
        "compile_backend": "aot_eager",
    }
    without = _generate(tiny_model(), **common, compile_decode=False, few_rows_linear=False)
    for grouped in (False, True):
        with_mode = _generate(
            tiny_model(),
            **common,
            compile_decode=compiled,
            few_rows_linear=True,
            few_rows_linear_group=grouped,
        )
        _assert_same(with_mode, without, tolerance=1e-6 if compiled else 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("grouped", [False, True], ids=["each", "grouped"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernels_in_captured_steps_decode_as_cublas(
    compiled: bool, dtype: torch.dtype, grouped: bool
) -> None:
    """Buckets of 1 to 8 rows captured with the few-rows kernels against the same steps on cuBLAS."""
    common = {"max_rows": 8, "page_size": 4, "max_context": 64, "compile_decode": compiled}
    with_kernels = _generate(
        tiny_model().to("cuda", dtype), **common, few_rows_linear=True, few_rows_linear_group=grouped
    )
    cublas = _generate(tiny_model().to("cuda", dtype), **common, few_rows_linear=False)
    _assert_same(with_kernels, cublas, tolerance=1e-4 if dtype == torch.float32 else 3e-2)
