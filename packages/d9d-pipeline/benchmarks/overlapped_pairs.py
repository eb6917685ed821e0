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

Run (GPU):  python3 packages/d9d-pipeline/benchmarks/overlapped_pairs.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from d9d.pipeline import (
    DualPipeVScheduleConfig,
    LocalPipelineExecutor,
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


def _build(
    args: argparse.Namespace, overlap: bool, cycles: int
) -> tuple[LocalPipelineExecutor, list[_Stage]]:
    program = build_program(
        DualPipeVScheduleConfig(overlap=overlap), num_ranks=2, num_microbatches=args.microbatches
    )
    torch.manual_seed(0)
    kind = _Stage if args.no_points else _PointedStage
    stages = [kind(args.layers, args.width, cycles).cuda().to(torch.bfloat16) for _ in range(4)]
    executor = LocalPipelineExecutor(program, dict(enumerate(stages)), device=torch.device("cuda"))
    return executor, stages


def _step(executor: LocalPipelineExecutor, stages: list[_Stage], batch: torch.Tensor) -> list[torch.Tensor]:
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    return executor.step({"h": batch}, loss_fn=lambda out, m: out["h"].float().pow(2).mean())


def _time(
    executor: LocalPipelineExecutor, stages: list[_Stage], batch: torch.Tensor, steps: int
) -> tuple[float, float]:
    """Step time (CUDA events) and the host's time to issue a step, in ms."""
    for _ in range(2):
        _step(executor, stages, batch)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = 0.0
    start.record()
    for _ in range(steps):
        begin = time.perf_counter()
        _step(executor, stages, batch)
        host += time.perf_counter() - begin
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, host * 1000 / steps


def _concurrent_ms(
    executor: LocalPipelineExecutor, stages: list[_Stage], batch: torch.Tensor
) -> tuple[float, int]:
    """Milliseconds of one step in which kernels of two or more streams ran, and the stream count."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(executor, stages, batch)
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
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--wait-us", type=float, default=300.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-host", action="store_true", help="cProfile one overlapped step")
    parser.add_argument(
        "--no-points", action="store_true", help="stages without overlap points (one thread per pair)"
    )
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    cycles = _cycles_for(args.wait_us)
    batch = torch.randn(args.rows * args.microbatches, args.width, device="cuda", dtype=torch.bfloat16)
    runs = {mode: _build(args, mode, cycles) for mode in (True, False)}

    losses = {mode: _step(*runs[mode], batch) for mode in runs}
    torch.testing.assert_close(torch.stack(losses[True]), torch.stack(losses[False]))
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad)
    print("losses and gradients: overlap on == off")

    times: dict[bool, list[float]] = {True: [], False: []}
    host: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for mode in (True, False):
            step_ms, host_ms = _time(*runs[mode], batch, args.steps)
            times[mode].append(step_ms)
            host[mode].append(host_ms)
    ratios = [off / on for on, off in zip(times[True], times[False], strict=True)]

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    print(
        f"{torch.cuda.get_device_name()}, DualPipeV p=2 m={args.microbatches}, {args.layers} layers/stage, "
        f"{args.rows}x{args.width} bf16 matmuls, wait {args.wait_us:.0f} us per layer and pass, "
        f"{args.repeats} alternating rounds of {args.steps} steps"
        + (", no overlap points" if args.no_points else ", an overlap point after each layer")
    )
    print(f"step ms, overlap on:  {spread(times[True])}, host issues it in {spread(host[True])}")
    print(f"step ms, overlap off: {spread(times[False])}, host issues it in {spread(host[False])}")
    print(f"off / on: {spread(ratios)}")
    for mode in (True, False):
        both, streams = _concurrent_ms(*runs[mode], batch)
        name = "on" if mode else "off"
        print(f"overlap {name}: {streams} streams with kernels, two at once for {both:.1f} ms of a step")
    if args.profile_host:
        profiler = cProfile.Profile()
        profiler.enable()
        _step(*runs[True], batch)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())


if __name__ == "__main__":
    main()
