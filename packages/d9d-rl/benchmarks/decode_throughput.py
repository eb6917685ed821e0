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

The engine decodes through its static decode step (device-resident rows, ``paged_decode_attention``
over the paged pool in place, a CUDA graph per batch-size bucket on CUDA; ``--no-cuda-graphs``
runs the same step eagerly; ``--compile-decode`` compiles its model part with ``torch.compile``
first, ``EmbeddedEngineConfig.compile_decode``: the warm-up call compiles, so the timed calls
replay graphs of the compiled kernels). Beside tokens/s of both sides and their ratio, each point prints the
engine's HBM roofline: the bytes its decode steps must read at least (all weights once per step,
plus every decoding row's keys and values for its current length, from ``engine.last_stats``) over
``--bandwidth`` (default 4.8 TB/s, the H200's HBM3e), as a fraction of two times: the engine's
whole call (prefills, sampling and the host's planning included: ``roofline``) and the device time
of its decode steps alone (CUDA events around each step, ``EngineStats.decode_seconds``: ``decode
roofline``). ``ms/step`` is that decode time per step; ``prefill s`` the prefills' device time.
``--few-rows-linear both`` adds a second engine without d9d-kernels' few-rows kernel (its linears
on cuBLAS), alternating with the others; ``--decode-ahead both`` likewise a second engine whose
host reads every step's tokens before launching the next (``decode_ahead=False``), and
``--few-rows-linear-group both`` one with a launch per linear against one launch for q/k/v and
for gate/up, ``--compile-prefill both`` one with eager prefills, and ``--prefill-graphs both``
one whose single-prompt prefills run eagerly instead of as replayed graphs;
``--profile TOP`` prints each engine's TOP kernels per decode step from one more profiled call.

Both models stay in memory for the alternation, and transformers keeps its static cache between
calls: at the 8B width and batch 256 the two caches and weights may not fit one GPU together
(pass fewer ``--batches``). On CPU transformers compiles only with ``--compile-cpu`` (slow).

GPU (one H200; the issue's table):
    uv run packages/d9d-rl/benchmarks/decode_throughput.py
GPU, the goal's point (batch 64) and two smaller ones at the 0.6B width, in a few minutes:
    uv run packages/d9d-rl/benchmarks/decode_throughput.py --widths qwen3-0.6b --batches 1 16 64 --repeats 2
GPU, the engine's decode step compiled, at the 0.6B width (compare ms/step with the same command
without ``--compile-decode``):
    uv run packages/d9d-rl/benchmarks/decode_throughput.py --widths qwen3-0.6b --batches 1 64 \
        --repeats 2 --compile-decode
CPU smoke run (tiny widths, seconds; add ``--compile-decode`` for the compiled step, a minute):
    uv run packages/d9d-rl/benchmarks/decode_throughput.py --quick
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
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


@dataclass(frozen=True)
class EnginePoint:
    tokens_per_s: float
    roofline_bytes: int
    seconds: float
    decode_seconds: float
    prefill_seconds: float
    decode_steps: int
    graph_buckets: tuple[int, ...]


@dataclass(frozen=True)
class Point:
    tokens: int
    reference_tokens_per_s: float | None  # None with --sides engine
    engine: EnginePoint | None  # None with --sides transformers
    variant: Variant | None  # a 'both' switch: the second engine


@dataclass(frozen=True)
class Variant:
    label: str  # what the second engine lacks
    tokens_per_s: float
    decode_seconds: float
    speedups: list[float]  # per repeat: the second engine's call time over the first's


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, a tied tensor once."""
    tensors = {t.untyped_storage().data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


def _roofline_bytes(engine: EmbeddedRolloutEngine) -> int:
    """What the last call's decode steps read at least: the weights once per step, plus each
    decoding row's keys and values for its length (every layer)."""
    stats = engine.last_stats
    assert stats is not None
    spec, model = engine.model.spec, engine.model
    element = next(p for p in model.parameters() if p.is_floating_point()).element_size()
    kv_per_token = len(model.model.decoder_layers()) * spec.num_kv_heads * 2 * spec.head_dim * element
    return stats.decode_steps * _weight_bytes(model) + stats.decode_context_tokens * kv_per_token


def _config(width: str, vocab: int, context: int) -> dict[str, Any]:
    return {**WIDTHS[width], "vocab_size": vocab, "max_position_embeddings": context, "rope_theta": 1e6}


def _d9d_engine(
    fields: dict[str, Any],
    workload: Workload,
    device: torch.device,
    dtype: torch.dtype,
    *,
    graphs: bool,
    compile_decode: bool,
    few_rows_linear: bool | None,
    few_rows_linear_group: bool,
    decode_ahead: bool,
    compile_prefill: bool | None,
    prefill_graphs: bool | None,
    fused_pool_write: bool,
    longest_rows_first: bool,
    fused_qk_norm_rope: bool,
    admission_wait_steps: int,
) -> tuple[EmbeddedRolloutEngine, Callable[[], object]]:
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderCausalLM(Qwen3DenseConfig.model_validate({**fields, "model_type": "qwen3"}))
        model.reset_parameters()
    config = EmbeddedEngineConfig(
        max_rows=workload.batch,
        max_context=fields["max_position_embeddings"],
        cuda_graphs=graphs and device.type == "cuda",
        compile_decode=compile_decode,
        few_rows_linear=few_rows_linear,
        few_rows_linear_group=few_rows_linear_group,
        decode_ahead=decode_ahead,
        compile_prefill=compile_prefill,
        prefill_graphs=prefill_graphs,
        fused_pool_write=fused_pool_write,
        longest_rows_first=longest_rows_first,
        fused_qk_norm_rope=fused_qk_norm_rope,
        admission_wait_steps=admission_wait_steps,
    )
    engine = EmbeddedRolloutEngine(model.to(dtype), config=config)
    sampling = SamplingParams(temperature=0.0, max_tokens=max(workload.lengths))
    return engine, lambda: engine.generate_capped(workload.prompts, sampling, workload.lengths)


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


def _print_kernel_profile(engine: EmbeddedRolloutEngine, run: Callable[[], object], top: int) -> None:
    """One more engine call under the profiler: its GPU kernels per decode step, summed by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        run()
        torch.cuda.synchronize()
    stats = engine.last_stats
    assert stats is not None
    steps = max(1, stats.decode_steps)
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time
            counts[event.name] = counts.get(event.name, 0) + 1
    print(
        f"  profile: {sum(totals.values()) / steps:.1f} us of kernels and "
        f"{sum(counts.values()) / steps:.0f} kernels per decode step (prefills and sampling included), "
        f"over {steps} steps; the top {top}:",
        flush=True,
    )
    for name, total in sorted(totals.items(), key=lambda item: -item[1])[:top]:
        print(
            f"  {total / steps:9.1f} us/step {counts[name] / steps:6.1f}/step "
            f"{total / counts[name]:7.2f} us each  {name[:110]}",
            flush=True,
        )


def _timed(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _point(args: argparse.Namespace, width: str, batch: int, device: torch.device) -> Point:
    rng = random.Random(args.seed)
    rows = batch * args.waves
    workload = Workload(
        prompts=[[rng.randrange(1, args.vocab) for _ in range(args.prompt_length)] for _ in range(rows)],
        lengths=[rng.randint(args.min_completion, args.max_completion) for _ in range(rows)],
        batch=batch,
    )
    fields = _config(width, args.vocab, args.prompt_length + args.max_completion + 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    few_rows = {"auto": None, "on": True, "off": False, "both": True}[args.few_rows_linear]
    ahead = args.decode_ahead != "off"
    group = args.few_rows_linear_group != "off"
    prefill = {"auto": None, "on": True, "off": False, "both": True}[args.compile_prefill]
    prefill_graphs = {"auto": None, "on": True, "off": False, "both": True}[args.prefill_graphs]

    def engine_with(
        few_rows_linear: bool | None,
        decode_ahead: bool,
        few_rows_linear_group: bool = group,
        compile_prefill: bool | None = prefill,
        graphed_prefills: bool | None = prefill_graphs,
        fused_pool_write: bool = args.fused_pool_write != "off",
        longest_rows_first: bool = args.longest_rows_first != "off",
        fused_qk_norm_rope: bool = args.fused_qk_norm_rope != "off",
    ) -> tuple[EmbeddedRolloutEngine, Callable[[], object]]:
        return _d9d_engine(
            fields,
            workload,
            device,
            dtype,
            graphs=not args.no_cuda_graphs,
            compile_decode=args.compile_decode,
            few_rows_linear=few_rows_linear,
            few_rows_linear_group=few_rows_linear_group,
            decode_ahead=decode_ahead,
            compile_prefill=compile_prefill,
            prefill_graphs=graphed_prefills,
            fused_pool_write=fused_pool_write,
            longest_rows_first=longest_rows_first,
            fused_qk_norm_rope=fused_qk_norm_rope,
            admission_wait_steps=args.admission_wait_steps,
        )

    runs: dict[str, Callable[[], object]] = {}
    engines: dict[str, EmbeddedRolloutEngine] = {}
    if args.sides != "transformers":
        engines["d9d"], runs["d9d"] = engine_with(few_rows, ahead)
    if args.sides != "engine":
        runs["transformers"] = _transformers_generate(fields, workload, device, dtype, args.compile_cpu)
    label = None
    if args.sides != "both":
        pass  # one side: no second engine
    elif args.few_rows_linear == "both":
        label = "without few_rows_linear (cuBLAS)"
        engines["variant"], runs["variant"] = engine_with(False, ahead)
    elif args.decode_ahead == "both":
        label = "without decode_ahead"
        engines["variant"], runs["variant"] = engine_with(few_rows, False)
    elif args.few_rows_linear_group == "both":
        label = "without few_rows_linear_group (a launch per linear)"
        engines["variant"], runs["variant"] = engine_with(few_rows, ahead, False)
    elif args.compile_prefill == "both":
        label = "without compile_prefill (eager prefills)"
        engines["variant"], runs["variant"] = engine_with(few_rows, ahead, group, False)
    elif args.prefill_graphs == "both":
        label = "without prefill_graphs (eager single prefills)"
        engines["variant"], runs["variant"] = engine_with(few_rows, ahead, group, prefill, False)
    elif args.fused_pool_write == "both":
        label = "without fused_pool_write (index_copy_ writes)"
        engines["variant"], runs["variant"] = engine_with(
            few_rows, ahead, group, prefill, prefill_graphs, False
        )
    elif args.longest_rows_first == "both":
        label = "without longest_rows_first (attention rows in order)"
        engines["variant"], runs["variant"] = engine_with(
            few_rows, ahead, group, prefill, prefill_graphs, args.fused_pool_write != "off", False
        )
    elif args.fused_qk_norm_rope == "both":
        label = "without fused_qk_norm_rope (a qk_norm_rope launch per layer)"
        engines["variant"], runs["variant"] = engine_with(few_rows, ahead, fused_qk_norm_rope=False)
    times: dict[str, list[float]] = {name: [] for name in runs}
    decode_seconds: dict[str, list[float]] = {name: [] for name in engines}
    prefill_seconds: list[float] = []
    for name, run in runs.items():
        seconds = _timed(run, device)
        warmed = engines[name].last_stats if name in engines else None
        first_runs = (
            "" if warmed is None else f" ({warmed.warm_up_seconds:.1f} s of first runs: compiling, capturing)"
        )
        print(f"  {width} batch {batch}: {name} warm-up {seconds:.1f} s{first_runs}", flush=True)
    for repeat in range(args.repeats):  # alternating, so drift hits both sides alike
        for name, run in runs.items():
            times[name].append(_timed(run, device))
            print(f"  {width} batch {batch}: {name} call {repeat + 1} {times[name][-1]:.1f} s", flush=True)
            if name in engines:
                stats = engines[name].last_stats
                assert stats is not None
                decode_seconds[name].append(stats.decode_seconds)
                if name == "d9d":
                    prefill_seconds.append(stats.prefill_seconds)
    point = _summary(workload, times, decode_seconds, prefill_seconds, engines, label)
    # the row first: a profiled call cut short by a timeout loses only the profile
    _print_point(width, batch, point, args.bandwidth)
    if args.profile and device.type == "cuda":
        for name, profiled in engines.items():
            print(f"  {width} batch {batch}, engine {name}:", flush=True)
            _print_kernel_profile(profiled, runs[name], args.profile)
    return point


def _summary(
    workload: Workload,
    times: dict[str, list[float]],
    decode_seconds: dict[str, list[float]],
    prefill_seconds: list[float],
    engines: dict[str, EmbeddedRolloutEngine],
    label: str | None,
) -> Point:
    """The medians of a point's timed calls."""
    tokens = sum(workload.lengths)
    reference = tokens / statistics.median(times["transformers"]) if "transformers" in times else None
    if "d9d" not in engines:
        return Point(tokens=tokens, reference_tokens_per_s=reference, engine=None, variant=None)
    engine = engines["d9d"]
    stats = engine.last_stats
    assert stats is not None
    return Point(
        tokens=tokens,
        reference_tokens_per_s=reference,
        engine=EnginePoint(
            tokens_per_s=tokens / statistics.median(times["d9d"]),
            roofline_bytes=_roofline_bytes(engine),  # the same every call: same rows, same lengths
            seconds=statistics.median(times["d9d"]),
            decode_seconds=statistics.median(decode_seconds["d9d"]),
            prefill_seconds=statistics.median(prefill_seconds),
            decode_steps=stats.decode_steps,
            graph_buckets=stats.graph_buckets,
        ),
        variant=None
        if label is None
        else Variant(
            label=label,
            tokens_per_s=tokens / statistics.median(times["variant"]),
            decode_seconds=statistics.median(decode_seconds["variant"]),
            speedups=[v / d for v, d in zip(times["variant"], times["d9d"], strict=True)],
        ),
    )


def _print_point(width: str, batch: int, point: Point, bandwidth: float) -> None:
    reference = point.reference_tokens_per_s
    hf = "n/a" if reference is None else f"{reference:.1f}"
    engine = point.engine
    if engine is None:
        print(f"{width:<12}{batch:>6}{point.tokens:>9}{'n/a':>12}{hf:>12}{'n/a':>7}", flush=True)
        return
    achieved = engine.roofline_bytes / engine.seconds
    steps = max(1, engine.decode_steps)
    ratio = "n/a" if reference is None else f"{engine.tokens_per_s / reference:.2f}"
    print(
        f"{width:<12}{batch:>6}{point.tokens:>9}{engine.tokens_per_s:>12.1f}{hf:>12}{ratio:>7}"
        f"{engine.roofline_bytes / steps / 1e6:>10.1f}{achieved / 1e9:>10.1f}"
        f"{achieved / bandwidth:>9.1%}{engine.decode_seconds / steps * 1e3:>9.2f}"
        f"{engine.roofline_bytes / engine.decode_seconds / bandwidth:>16.1%}"
        f"{engine.prefill_seconds:>10.2f}  {','.join(map(str, engine.graph_buckets)) or 'off'}",
        flush=True,
    )
    variant = point.variant
    if variant is not None:
        print(
            f"{'':<12}{'':>6}  {variant.label}: {variant.tokens_per_s:.1f} tok/s, "
            f"{variant.decode_seconds / steps * 1e3:.2f} ms/step; with it "
            f"{engine.tokens_per_s / variant.tokens_per_s:.2f}x tok/s "
            f"(repeats {min(variant.speedups):.2f}-{max(variant.speedups):.2f}x), "
            f"{variant.decode_seconds / engine.decode_seconds:.2f}x per decode step",
            flush=True,
        )


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
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the engine's decode step eagerly")
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="compile the engine's decode step with torch.compile (EmbeddedEngineConfig.compile_decode)",
    )
    parser.add_argument(
        "--few-rows-linear",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="EmbeddedEngineConfig.few_rows_linear (auto: None, on for CUDA); both: the engine with "
        "it and a second engine without it (cuBLAS), alternating, each row followed by the second's figures",
    )
    for switch, default in (
        ("few-rows-linear-group", "on"),
        ("decode-ahead", "on"),
        ("fused-pool-write", "on"),
        ("longest-rows-first", "on"),
        ("fused-qk-norm-rope", "off"),
    ):
        field = switch.replace("-", "_")
        parser.add_argument(
            f"--{switch}",
            choices=["on", "off", "both"],
            default=default,
            help=f"EmbeddedEngineConfig.{field}; both: the engine with it and a second engine without it, "
            "alternating, each row followed by the second's figures",
        )
    parser.add_argument(
        "--compile-prefill",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="EmbeddedEngineConfig.compile_prefill (auto: None, as --compile-decode); both: the engine "
        "with it and a second engine with eager prefills, alternating",
    )
    parser.add_argument(
        "--prefill-graphs",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="EmbeddedEngineConfig.prefill_graphs (auto: None, on with CUDA graphs and eager prefills; on "
        "needs CUDA graphs); both: the engine with it and a "
        "second engine without it, alternating",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="CUDA: after each point's timed calls, one more engine call under the profiler; print its "
        "TOP kernels by time per decode step (each engine with --few-rows-linear both)",
    )
    parser.add_argument(
        "--admission-wait-steps",
        type=int,
        default=0,
        metavar="N",
        help="EmbeddedEngineConfig.admission_wait_steps of every engine (freed slots wait up to N "
        "forwards so that waiting prompts prefill together)",
    )
    parser.add_argument(
        "--sides",
        choices=["both", "engine", "transformers"],
        default="both",
        help="which sides run: a point too long for one call can time each side in its own call "
        "(no ratio is printed then; a 'both' switch needs both sides)",
    )
    parser.add_argument(
        "--bandwidth", type=float, default=4.8e12, help="HBM bytes/s of the roofline (H200: 4.8e12)"
    )
    args = parser.parse_args()
    switches = [
        args.few_rows_linear,
        args.decode_ahead,
        args.few_rows_linear_group,
        args.compile_prefill,
        args.prefill_graphs,
        args.fused_pool_write,
        args.longest_rows_first,
        args.fused_qk_norm_rope,
    ]
    if switches.count("both") > 1:
        parser.error(
            "--few-rows-linear, --decode-ahead, --few-rows-linear-group, --compile-prefill, "
            "--prefill-graphs, --fused-pool-write, --longest-rows-first and --fused-qk-norm-rope: 'both' "
            "adds a second engine, "
            "pass it to one of them"
        )
    if args.fused_qk_norm_rope != "off" and args.fused_pool_write != "on":
        parser.error(
            "--fused-qk-norm-rope needs --fused-pool-write on (the kernel writes the normalized keys)"
        )
    if args.sides != "both" and "both" in switches:
        parser.error("a 'both' switch compares two engines beside transformers: it needs --sides both")
    if args.quick:
        args.widths, args.batches, args.prompt_length = ["tiny"], [1, 4], 16
        args.min_completion, args.max_completion, args.vocab = 4, 24, 256
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    completions = f"{args.min_completion}..{args.max_completion}"
    print(
        f"device={device} prompts={args.prompt_length} completions={completions} "
        f"roofline bandwidth={args.bandwidth / 1e12:.2f} TB/s "
        f"engine decode step: {'compiled' if args.compile_decode else 'eager'}, "
        f"{'no CUDA graphs' if args.no_cuda_graphs else 'CUDA graphs on CUDA'}",
        flush=True,  # each point as it ends: a run cut short keeps the points so far
    )
    print(
        f"{'width':<12}{'batch':>6}{'tokens':>9}{'d9d tok/s':>12}{'hf tok/s':>12}{'ratio':>7}"
        f"{'MB/step':>10}{'d9d GB/s':>10}{'roofline':>9}{'ms/step':>9}{'decode roofline':>16}"
        f"{'prefill s':>10}  graph buckets",
        flush=True,
    )
    for width in args.widths:
        for batch in args.batches:
            _point(args, width, batch, device)  # prints its row as it ends


if __name__ == "__main__":
    # the engine's first runs (compiling, capturing) print as each ends: a call cut short shows how far it got
    logging.basicConfig(format="  %(message)s", stream=sys.stdout)
    logging.getLogger("d9d.rl").setLevel(logging.INFO)
    main()
