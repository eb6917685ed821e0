"""DualPipeV's overlapped pairs on one GPU: one stage's waiting hides behind the other's compute.

DualPipeV on two ranks has four stages; here all four run in one process
(``LocalPipelineExecutor``) on one GPU, each rank's stages on their own CUDA streams as on real
ranks. A stage is ``--layers`` layers of a ``(rows, width) x (width, width)`` matmul and GELU
followed by a stand-in for an expert-parallel all-to-all: a kernel that only waits
(``torch.cuda._sleep``) for ``--wait-us`` microseconds, in the forward and again in the backward,
as an NCCL receive holds the stream that waits for it while leaving the SMs free. Each stage has
an overlap point after each layer (``--no-points``: none, the pair's halves then run one after the
other on one thread, still on their two streams). No real
communication runs: the benchmark shows what the interleaving can hide, not an all-to-all's cost.

Rounds alternate ``overlap: true`` and ``overlap: false`` (each mode's step timed with CUDA events
over ``--steps`` steps after warm-up); printed: each mode's median step time with its range, the
ratio, and from one profiled step per mode the time in which kernels of two streams ran at once.
The two modes' losses and gradients are compared first.

``--model qwen3-moe`` runs real stages instead: d9d-hf's Qwen3-MoE at Qwen3-30B-A3B widths,
``--layers`` (1) decoder layers per stage, one ``--seq`` (4096) sequence per microbatch, bf16, an
overlap point after each layer (``--compile`` compiles each decoder layer). On one GPU nothing
communicates: what can overlap is one stage's compute with the other's.

Run (GPU):  python3 packages/d9d-pipeline/benchmarks/overlapped_pairs.py [--repeats 3] [--model qwen3-moe]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

# the Qwen3-30B-A3B shape and the figures' format of d9d-hf's benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "d9d-hf" / "benchmarks"))
from _stats import spread
from train_throughput import MOE_30B_A3B_6_LAYERS

from d9d.hf import DecoderCausalLM, DecoderInputs
from d9d.hf.qwen3 import Qwen3MoeConfig
from d9d.pipeline import (
    DualPipeVScheduleConfig,
    LocalPipelineExecutor,
    PipelineProgram,
    PipelineStageInfo,
    build_program,
)


class _Wait(torch.autograd.Function):
    """Identity whose forward and backward each hold the stream for a while (a stand-in for a2a)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cycles: int) -> torch.Tensor:
        ctx.cycles = cycles
        torch.cuda._sleep(cycles)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        torch.cuda._sleep(ctx.cycles)
        return grad, None


class _Stage(nn.Module):
    def __init__(self, layers: int, width: int, cycles: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        self.cycles = cycles
        self._point: Any = None

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = inputs["h"]
        for layer in self.layers:
            h = _Wait.apply(nn.functional.gelu(layer(h)), self.cycles)
            if self._point is not None:
                self._point(h)
        return {"h": h}


class _PointedStage(_Stage):
    """With an overlap point after each layer: the pair's halves take turns there."""

    def set_overlap_point(self, point: Any) -> None:
        self._point = point


def _cycles_for(us: float) -> int:
    """Sleep cycles that take ``us`` microseconds on this GPU (measured)."""
    probe = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm-up
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    return int(probe * us / (start.elapsed_time(end) * 1000))


@dataclass
class _Run:
    executor: LocalPipelineExecutor
    stages: list[nn.Module]
    batch: Any
    loss_fn: Any


def _standin(args: argparse.Namespace, program: PipelineProgram, cycles: int) -> _Run:
    torch.manual_seed(0)
    kind = _Stage if args.no_points else _PointedStage
    stages: list[nn.Module] = [
        kind(args.layers, args.width, cycles).cuda().to(torch.bfloat16) for _ in range(4)
    ]
    executor = LocalPipelineExecutor(program, dict(enumerate(stages)), device=torch.device("cuda"))
    batch = {"h": torch.randn(args.rows * args.microbatches, args.width, device="cuda", dtype=torch.bfloat16)}
    return _Run(executor, stages, batch, lambda out, m: out["h"].float().pow(2).mean())


def _qwen3_moe(args: argparse.Namespace, program: PipelineProgram) -> _Run:
    """Qwen3-30B-A3B widths, ``--layers`` decoder layers per stage, one sequence per microbatch."""
    config = Qwen3MoeConfig.model_validate({**MOE_30B_A3B_6_LAYERS, "num_hidden_layers": 4 * args.layers})
    torch.manual_seed(0)
    stages: list[nn.Module] = [
        DecoderCausalLM(config, stage=PipelineStageInfo(s, 4), attention_backend="sdpa")
        .cuda()
        .to(torch.bfloat16)
        for s in range(4)
    ]
    for stage in stages:
        stage.reset_parameters()
        if args.compile:
            stage.model.compile_layers()
    executor = LocalPipelineExecutor(program, dict(enumerate(stages)), device=torch.device("cuda"))
    ids = torch.randint(0, 151936, (args.microbatches, args.seq), device="cuda")
    batch = DecoderInputs(input_ids=ids, labels=ids.clone(), summed_losses=True)
    tokens = ids.numel()
    return _Run(executor, stages, batch, lambda losses, m: losses.float().sum() / tokens)


def _build(args: argparse.Namespace, overlap: bool, cycles: int) -> _Run:
    program = build_program(
        DualPipeVScheduleConfig(overlap=overlap), num_ranks=2, num_microbatches=args.microbatches
    )
    if args.model == "qwen3-moe":
        return _qwen3_moe(args, program)
    return _standin(args, program, cycles)


def _step(run: _Run) -> list[torch.Tensor]:
    for stage in run.stages:
        stage.zero_grad(set_to_none=True)
    return run.executor.step(run.batch, loss_fn=run.loss_fn)


def _time(run: _Run, steps: int) -> tuple[float, float]:
    """Step time (CUDA events) and the host's time to issue a step, in ms."""
    for _ in range(2):
        _step(run)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = 0.0
    start.record()
    for _ in range(steps):
        begin = time.perf_counter()
        _step(run)
        host += time.perf_counter() - begin
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, host * 1000 / steps


def _concurrent_ms(run: _Run) -> tuple[float, int]:
    """Milliseconds of one step in which kernels of two or more streams ran, and the stream count."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(run)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    points: list[tuple[float, int, int]] = []
    streams: set[int] = set()
    for e in trace.get("traceEvents", []):
        if e.get("cat") != "kernel":
            continue
        stream = int(e.get("args", {}).get("stream", -1))
        streams.add(stream)
        points += [(float(e["ts"]), 1, stream), (float(e["ts"]) + float(e["dur"]), -1, stream)]
    active: dict[int, int] = {}
    both, last = 0.0, 0.0
    for ts, delta, stream in sorted(points, key=lambda p: (p[0], p[1])):
        if sum(1 for v in active.values() if v > 0) >= 2:
            both += ts - last
        active[stream] = active.get(stream, 0) + delta
        last = ts
    return both / 1000, len(streams)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["standin", "qwen3-moe"], default="standin")
    parser.add_argument("--layers", type=int, default=None, help="per stage (4 stand-in, 1 Qwen3-MoE)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=4096, help="Qwen3-MoE sequence length")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--wait-us", type=float, default=300.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-host", action="store_true", help="cProfile one overlapped step")
    parser.add_argument("--compile", action="store_true", help="Qwen3-MoE: compile each decoder layer")
    parser.add_argument(
        "--no-points",
        action="store_true",
        help="stand-in stages without overlap points (a pair then runs one after the other on one thread)",
    )
    args = parser.parse_args()
    if args.layers is None:
        args.layers = 1 if args.model == "qwen3-moe" else 4
    torch.backends.cuda.matmul.allow_tf32 = False
    cycles = _cycles_for(args.wait_us)
    runs = {mode: _build(args, mode, cycles) for mode in (True, False)}

    losses = {mode: _step(run) for mode, run in runs.items()}
    torch.testing.assert_close(torch.stack(losses[True]), torch.stack(losses[False]))
    for a, b in zip(runs[True].stages, runs[False].stages, strict=True):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            if p.grad is not None or q.grad is not None:
                assert p.grad is not None and q.grad is not None
                torch.testing.assert_close(p.grad, q.grad)
    print("losses and gradients: overlap on == off")

    times: dict[bool, list[float]] = {True: [], False: []}
    host: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for mode in (True, False):
            step_ms, host_ms = _time(runs[mode], args.steps)
            times[mode].append(step_ms)
            host[mode].append(host_ms)
    ratios = [off / on for on, off in zip(times[True], times[False], strict=True)]

    if args.model == "qwen3-moe":
        shape = f"Qwen3-30B-A3B widths, seq {args.seq}, one sequence per microbatch" + (
            ", compiled layers" if args.compile else ", eager"
        )
    else:
        shape = f"{args.rows}x{args.width} bf16 matmuls, wait {args.wait_us:.0f} us per layer and pass" + (
            ", no overlap points" if args.no_points else ", an overlap point after each layer"
        )
    print(
        f"{torch.cuda.get_device_name()}, DualPipeV p=2 m={args.microbatches}, {args.layers} layers/stage, "
        f"{shape}, {args.repeats} alternating rounds of {args.steps} steps"
    )
    print(f"step ms, overlap on:  {spread(times[True])}, host issues it in {spread(host[True])}")
    print(f"step ms, overlap off: {spread(times[False])}, host issues it in {spread(host[False])}")
    print(f"off / on: {spread(ratios)}")
    for mode in (True, False):
        both, streams = _concurrent_ms(runs[mode])
        name = "on" if mode else "off"
        print(f"overlap {name}: {streams} streams with kernels, two at once for {both:.1f} ms of a step")
    if args.profile_host:
        profiler = cProfile.Profile()
        profiler.enable()
        _step(runs[True])
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())


if __name__ == "__main__":
    main()
