"""``few_rows_linear`` against ``F.linear`` (cuBLAS) at decode shapes, 1 to 64 rows; then one
input's projections (q/k/v, gate/up) three ways: cuBLAS, ``few_rows_linear`` per weight, and
``few_rows_linear_group`` (one launch).

Run:  python packages/d9d-kernels/benchmarks/bench_few_rows_linear.py   (--smoke on CPU)
      ... --groups-only   (only the group table)

Past 16 rows ``few_rows_linear`` is ``F.linear`` itself, so there the kernel side launches the
Triton kernels directly (their ``tl.dot`` tiles padded to 32 or 64 rows): the figures that decide
whether the op's 16-row limit should rise.

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

from d9d.kernels import KernelBackend, few_rows_linear, few_rows_linear_group
from d9d.kernels._triton.few_rows_linear_kernels import few_rows_linear_group_kernel, few_rows_linear_kernel

OP_ROWS_MAX = 16  # few_rows_linear's limit: past it the kernel side calls the kernels directly

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

GROUPS = {  # name: (in features k, each weight's out features)
    "0.6B q/k/v": (1024, (2048, 1024, 1024)),
    "0.6B gate+up": (1024, (3072, 3072)),
    "8B q/k/v": (4096, (4096, 1024, 1024)),
    "8B gate+up": (4096, (12288, 12288)),
}

Linear = Callable[[torch.Tensor, torch.Tensor], object]
GroupLinear = Callable[[torch.Tensor, list[torch.Tensor]], object]


def _graph(run: Callable[[], object]) -> torch.cuda.CUDAGraph:
    run()  # autotuning and compilation before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def _products(linear: Linear, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for x, w in zip(inputs, weights, strict=True):
            linear(x, w)

    return run


def _groups(
    linear: GroupLinear, inputs: list[torch.Tensor], weights: list[list[torch.Tensor]]
) -> Callable[[], None]:
    def run() -> None:
        for x, group in zip(inputs, weights, strict=True):
            linear(x, group)

    return run


def _median_cell(times: list[float]) -> str:
    return f"{statistics.median(times):8.2f} ({min(times):.2f}-{max(times):.2f})"


def _bench_groups(args: argparse.Namespace) -> None:
    op_sides: dict[str, GroupLinear] = {
        "cuBLAS": lambda x, ws: [F.linear(x, w) for w in ws],
        "per weight": lambda x, ws: [few_rows_linear(x, w) for w in ws],
        "one launch": few_rows_linear_group,
    }
    kernel_sides: dict[str, GroupLinear] = {
        "cuBLAS": lambda x, ws: [F.linear(x, w) for w in ws],
        "per weight": lambda x, ws: [few_rows_linear_kernel(x, w, None) for w in ws],
        "one launch": lambda x, ws: few_rows_linear_group_kernel(x, ws, None),
    }
    print(
        f"{'group':<14}{'k':>7}{'rows':>6}{'cuBLAS us':>22}{'per-weight us':>22}{'one-launch us':>22}"
        f"{'vs cuBLAS':>10}{'vs per-weight':>14}{'BW':>8}"
    )
    for name in args.groups:
        k, widths = GROUPS[name]
        copies = max(2, math.ceil(256e6 / (sum(widths) * k * 2)))
        weights = [
            [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for n in widths]
            for _ in range(copies)
        ]
        for rows in args.rows:
            sides = op_sides if rows <= OP_ROWS_MAX else kernel_sides
            inputs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            graphs = {side: _graph(_groups(linear, inputs, weights)) for side, linear in sides.items()}
            times = _alternate(graphs, args.repeats, copies)
            medians = {side: statistics.median(t) for side, t in times.items()}
            share = sum(widths) * k * 2 / (medians["one launch"] * 1e-6) / args.bandwidth
            print(
                f"{name:<14}{k:>7}{rows:>6}{''.join(f'{_median_cell(t):>22}' for t in times.values())}"
                f"{medians['cuBLAS'] / medians['one launch']:>9.2f}x"
                f"{medians['per weight'] / medians['one launch']:>13.2f}x{share:>8.1%}",
                flush=True,
            )
            del graphs, inputs
        del weights
        torch.cuda.empty_cache()


def _alternate(
    graphs: dict[str, torch.cuda.CUDAGraph], repeats: int, products: int
) -> dict[str, list[float]]:
    """Each side's microseconds per product over ``repeats`` rounds, the sides alternating."""
    times: dict[str, list[float]] = {side: [] for side in graphs}
    for _ in range(repeats):
        for side, graph in graphs.items():
            times[side].append(_replay_us(graph, products))
    return times


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
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s (H200: 4.8e12)")
    parser.add_argument("--groups", nargs="+", choices=sorted(GROUPS), default=list(GROUPS))
    parser.add_argument("--groups-only", action="store_true", help="skip the single-product table")
    parser.add_argument("--smoke", action="store_true", help="CPU: check the sides agree, no timing")
    args = parser.parse_args()
    if args.smoke or not torch.cuda.is_available():
        x, w = torch.randn(3, 64), torch.randn(40, 64)
        kernel = few_rows_linear(x, w, backend=KernelBackend.TRITON)
        torch.testing.assert_close(kernel, F.linear(x, w), rtol=1e-5, atol=1e-5)
        group = [torch.randn(40, 64), torch.randn(24, 64)]
        for out, weight in zip(
            few_rows_linear_group(x, group, backend=KernelBackend.TRITON), group, strict=True
        ):
            torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
        print("smoke: few_rows_linear and few_rows_linear_group equal F.linear at 3 rows of 64")
        return
    if not args.groups_only:
        _bench_singles(args)
    _bench_groups(args)


def _bench_singles(args: argparse.Namespace) -> None:
    op_sides: dict[str, Linear] = {"cuBLAS": F.linear, "few_rows_linear": few_rows_linear}
    kernel_sides: dict[str, Linear] = {
        "cuBLAS": F.linear,
        "few_rows_linear": lambda x, w: few_rows_linear_kernel(x, w, None),
    }
    print(
        f"{'shape':<14}{'k':>7}{'n':>8}{'rows':>6}{'cuBLAS us':>22}{'kernel us':>22}"
        f"{'speedup':>9}{'kernel BW':>11}"
    )
    for name in args.shapes:
        k, n = SHAPES[name]
        copies = max(2, math.ceil(256e6 / (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        for rows in args.rows:
            sides = op_sides if rows <= OP_ROWS_MAX else kernel_sides
            inputs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            graphs = {side: _graph(_products(linear, inputs, weights)) for side, linear in sides.items()}
            times = _alternate(graphs, args.repeats, copies)
            cells = [_median_cell(times[side]) for side in sides]
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
