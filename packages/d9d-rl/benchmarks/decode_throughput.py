"""Decode throughput of the embedded engine against transformers' ``generate`` (static cache, compiled).

Both sides get the same workload: ``batch * waves`` prompts of ``--prompt-length`` random tokens,
each with a completion length drawn uniformly from ``--min-completion`` to ``--max-completion``
(seeded), greedy, no stop tokens. The engine runs them with ``max_rows=batch`` (continuous
batching: a row that reaches its length frees its slot for the next prompt) through
``generate_capped``; transformers runs ``waves`` static batches of ``batch`` prompts, each decoding
to its longest drawn length (a static batch waits for its longest row) with
``cache_implementation="static"`` and ``torch.compile`` (its auto-compilation, ``CompileConfig``).
Throughput counts only the drawn completion tokens, over the whole call (prefill included).
Random weights of the Qwen3 widths (the same config on both sides; the weights differ, which does
not change the work). Each point: one warm-up call per side (compilation), then ``--repeats``
alternating timed calls; the table prints the medians.

Both models stay in memory for the alternation, and transformers keeps its static cache between
calls: at the 8B width and batch 256 the two caches and weights may not fit one GPU together
(pass fewer ``--batches``). On CPU transformers compiles only with ``--compile-cpu`` (slow).

GPU (one H200; the issue's table):
    uv run packages/d9d-rl/benchmarks/decode_throughput.py
CPU smoke run (tiny widths, seconds):
    uv run packages/d9d-rl/benchmarks/decode_throughput.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from d9d.hf import DecoderCausalLM
from d9d.hf.qwen3 import Qwen3DenseConfig
from d9d.rl import EmbeddedEngineConfig, EmbeddedRolloutEngine, SamplingParams

WIDTHS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    lengths: list[int]
    batch: int


def _config(width: str, vocab: int, context: int) -> dict[str, Any]:
    return {**WIDTHS[width], "vocab_size": vocab, "max_position_embeddings": context, "rope_theta": 1e6}


def _d9d_engine(fields: dict[str, Any], workload: Workload, device: torch.device, dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderCausalLM(Qwen3DenseConfig.model_validate({**fields, "model_type": "qwen3"}))
        model.reset_parameters()
    config = EmbeddedEngineConfig(max_rows=workload.batch, max_context=fields["max_position_embeddings"])
    engine = EmbeddedRolloutEngine(model.to(dtype), config=config)
    sampling = SamplingParams(temperature=0.0, max_tokens=max(workload.lengths))
    return lambda: engine.generate_capped(workload.prompts, sampling, workload.lengths)


def _transformers_generate(
    fields: dict[str, Any], workload: Workload, device: torch.device, dtype: torch.dtype, compile_cpu: bool
) -> Callable[[], object]:
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).eval()
    finally:
        torch.set_default_dtype(default)
    compile_config = transformers.CompileConfig()  # transformers' defaults (mode reduce-overhead)
    compile_config._compile_all_devices = compile_cpu  # transformers' switch to compile off CUDA too
    waves = [
        (
            torch.tensor(workload.prompts[start : start + workload.batch], device=device),
            max(workload.lengths[start : start + workload.batch]),
        )
        for start in range(0, len(workload.prompts), workload.batch)
    ]

    @torch.no_grad()
    def run() -> None:
        for ids, new_tokens in waves:
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                cache_implementation="static",
                compile_config=compile_config,
            )

    return run


def _timed(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _point(
    args: argparse.Namespace, width: str, batch: int, device: torch.device
) -> tuple[float, float, int]:
    rng = random.Random(args.seed)
    rows = batch * args.waves
    workload = Workload(
        prompts=[[rng.randrange(1, args.vocab) for _ in range(args.prompt_length)] for _ in range(rows)],
        lengths=[rng.randint(args.min_completion, args.max_completion) for _ in range(rows)],
        batch=batch,
    )
    fields = _config(width, args.vocab, args.prompt_length + args.max_completion + 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    runs = {
        "d9d": _d9d_engine(fields, workload, device, dtype),
        "transformers": _transformers_generate(fields, workload, device, dtype, args.compile_cpu),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        _timed(run, device)  # warm-up: compilation, allocator
    for _ in range(args.repeats):  # alternating, so drift hits both sides alike
        for name, run in runs.items():
            times[name].append(_timed(run, device))
    tokens = sum(workload.lengths)
    return tokens / statistics.median(times["d9d"]), tokens / statistics.median(times["transformers"]), tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny widths and shapes, for a CPU check")
    parser.add_argument("--widths", nargs="+", default=["qwen3-0.6b", "qwen3-8b"], choices=sorted(WIDTHS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    parser.add_argument("--waves", type=int, default=2, help="prompts per point: batch * waves")
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--min-completion", type=int, default=64)
    parser.add_argument("--max-completion", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-cpu", action="store_true", help="let transformers compile on CPU too")
    args = parser.parse_args()
    if args.quick:
        args.widths, args.batches, args.prompt_length = ["tiny"], [1, 4], 16
        args.min_completion, args.max_completion, args.vocab = 4, 24, 256
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    completions = f"{args.min_completion}..{args.max_completion}"
    print(f"device={device} prompts={args.prompt_length} completions={completions}")
    print(f"{'width':<12}{'batch':>6}{'tokens':>9}{'d9d tok/s':>12}{'hf tok/s':>12}{'ratio':>7}")
    for width in args.widths:
        for batch in args.batches:
            engine, reference, tokens = _point(args, width, batch, device)
            print(
                f"{width:<12}{batch:>6}{tokens:>9}{engine:>12.1f}{reference:>12.1f}{engine / reference:>7.2f}"
            )


if __name__ == "__main__":
    main()
