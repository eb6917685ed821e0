"""``few_rows_linear`` against ``F.linear`` (cuBLAS) at decode shapes, 1 to 64 rows.

Run:  python packages/d9d-kernels/benchmarks/bench_few_rows_linear.py   (--smoke on CPU)

Each shape is a Qwen3-0.6B or Qwen3-8B projection (q, k/v, o, gate/up, down, the 0.6B LM head).
Both sides run captured in one CUDA graph per side that multiplies by enough distinct copies of the
weight to exceed the L2 cache (256 MB), so every product reads its weight from HBM as a decode step
does; replays alternate between the sides. Every figure is the median over ``--repeats`` replays
(microseconds per product) with its range, and the kernel's share of ``--bandwidth``.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from d9d.kernels import KernelBackend, few_rows_linear

SHAPES = {  # name: (in features k, out features n)
    "0.6B q": (1024, 2048),
    "0.6B k/v": (1024, 1024),
    "0.6B o": (2048, 1024),
    "0.6B gate/up": (1024, 3072),
    "0.6B down": (3072, 1024),
    "0.6B head": (1024, 151936),
    "8B q/o": (4096, 4096),
    "8B k/v": (4096, 1024),
    "8B gate/up": (4096, 12288),
    "8B down": (12288, 4096),
}

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _graph(linear: Linear, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
    for x, w in zip(inputs, weights, strict=True):
        linear(x, w)  # autotuning and compilation before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(inputs, weights, strict=True):
            linear(x, w)
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph, products: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / products


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s (H200: 4.8e12)")
    parser.add_argument("--smoke", action="store_true", help="CPU: check the two sides agree, no timing")
    args = parser.parse_args()
    if args.smoke or not torch.cuda.is_available():
        x, w = torch.randn(3, 64), torch.randn(40, 64)
        kernel = few_rows_linear(x, w, backend=KernelBackend.TRITON)
        torch.testing.assert_close(kernel, F.linear(x, w), rtol=1e-5, atol=1e-5)
        print("smoke: few_rows_linear equals F.linear at (3, 64) x (40, 64)")
        return
    sides: dict[str, Linear] = {"cuBLAS": F.linear, "few_rows_linear": few_rows_linear}
    print(
        f"{'shape':<14}{'k':>7}{'n':>8}{'rows':>6}{'cuBLAS us':>22}{'kernel us':>22}"
        f"{'speedup':>9}{'kernel BW':>11}"
    )
    for name in args.shapes:
        k, n = SHAPES[name]
        copies = max(2, math.ceil(256e6 / (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        for rows in args.rows:
            inputs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            graphs = {side: _graph(linear, inputs, weights) for side, linear in sides.items()}
            times: dict[str, list[float]] = {side: [] for side in sides}
            for _ in range(args.repeats):
                for side, graph in graphs.items():
                    times[side].append(_replay_us(graph, copies))
            cells = []
            for side in sides:
                cells.append(
                    f"{statistics.median(times[side]):8.2f} ({min(times[side]):.2f}-{max(times[side]):.2f})"
                )
            kernel = statistics.median(times["few_rows_linear"])
            speedup = statistics.median(times["cuBLAS"]) / kernel
            share = n * k * 2 / (kernel * 1e-6) / args.bandwidth
            print(
                f"{name:<14}{k:>7}{n:>8}{rows:>6}{cells[0]:>22}{cells[1]:>22}{speedup:>8.2f}x{share:>10.1%}",
                flush=True,
            )
            del graphs, inputs
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
