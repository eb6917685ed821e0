"""The multi-tensor stochastic AdamW launch: how many blocks a program updates, and its warps.

Run:  python packages/d9d-kernels/benchmarks/bench_adamw_launch.py   (--smoke on CPU)

Steps parameter lists in bf16 with bf16 moments (14 bytes per parameter): Qwen3-0.6B's 310
tensors, two Qwen3-30B-A3B decoder layers (24 tensors, 1.25B parameters, mostly experts) and the
whole MoE model of ``train_throughput.py --model moe`` (75 tensors, 4.4B parameters), with
``adamw_step_multi`` under several launch shapes and a gradient scale (as d9d-loop steps it).
Every figure is the median over ``--repeats`` alternating rounds (CUDA events around ``--iters``
back-to-back steps) with its range, and the share of the copy bandwidth it reaches. Alone, the
kernel may not run as it does inside a training step: check a launch shape there too
(``train_throughput.py --profile`` prints the kernel's time per step).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from _harness import copy_bandwidth_gbs
from bench_adamw import qwen3_shapes

from d9d.kernels._triton.stochastic_rounding_kernels import adamw_step_multi


def qwen3_moe_layer_shapes(layers: int) -> list[tuple[int, ...]]:
    """``layers`` decoder layers at Qwen3-30B-A3B widths (128 experts of 768, hidden 2048)."""
    hidden, heads, kv_heads, head_dim, experts, ffn = 2048, 32, 4, 128, 128, 768
    layer = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden)]
    layer += [(hidden, heads * head_dim), (head_dim,), (head_dim,), (hidden,), (hidden,), (experts, hidden)]
    layer += [(experts, ffn, hidden), (experts, ffn, hidden), (experts, hidden, ffn)]
    return layer * layers


def qwen3_moe_model_shapes() -> list[tuple[int, ...]]:
    """The benchmark model of ``train_throughput.py --model moe``: 6 such layers, embedding and head."""
    vocab, hidden = 151936, 2048
    return [(vocab, hidden), *qwen3_moe_layer_shapes(6), (hidden,), (vocab, hidden)]


LAUNCHES: dict[str, dict[str, int]] = {
    "2 blocks of 1024, 4 warps (d9d)": {"block": 1024, "blocks_per_program": 2, "num_warps": 4},
    "1 block of 1024, 4 warps": {"block": 1024, "blocks_per_program": 1, "num_warps": 4},
    "1 block of 2048, 8 warps": {"block": 2048, "blocks_per_program": 1, "num_warps": 8},
    "4 blocks of 1024, 4 warps": {"block": 1024, "blocks_per_program": 4, "num_warps": 4},
}


def _time_ms(fn: Callable[[], object], device: str, iters: int) -> float:
    fn()
    if device != "cuda":
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _launch_times(
    shapes: list[tuple[int, ...]], device: str, repeats: int, iters: int
) -> dict[str, list[float]]:
    params = [torch.randn(shape, device=device).to(torch.bfloat16) for shape in shapes]
    grads = [torch.randn_like(p) for p in params]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    seeds = list(range(len(params)))

    def step(launch: dict[str, int]) -> None:
        adamw_step_multi(
            params, grads, exp_avgs, exp_avg_sqs, 1e-4, 0.9, 0.999, 1e-8, 0.1, 10, seeds, **launch
        )

    times: dict[str, list[float]] = {name: [] for name in LAUNCHES}
    for _ in range(repeats):
        for name, launch in LAUNCHES.items():
            times[name].append(_time_ms(lambda launch=launch: step(launch), device, iters))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script only")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    lists = {
        "Qwen3-0.6B": qwen3_shapes(smoke=False),
        "2 Qwen3-30B-A3B layers": qwen3_moe_layer_shapes(2),
        "the MoE benchmark model (6 layers, embedding, head)": qwen3_moe_model_shapes(),
    }
    if args.smoke:
        lists = {"tiny": [(1500,), (8,), (3, 700)]}
    bandwidth = copy_bandwidth_gbs(device)
    print(f"copy bandwidth {bandwidth:.0f} GB/s")
    for list_name, shapes in lists.items():
        times = _launch_times(shapes, device, args.repeats, args.iters)
        elements = sum(torch.Size(shape).numel() for shape in shapes)
        print(f"\n{list_name}: {len(shapes)} tensors, {elements / 1e6:.0f}M bf16 parameters, bf16 moments")
        print("| launch | ms | % copy bandwidth |\n|---|---|---|")
        for name, values in times.items():
            median = statistics.median(values)
            share = 100 * 14 * elements / (median * 1e-3) / 1e9 / bandwidth
            print(f"| {name} | {median:.3f} ({min(values):.3f}-{max(values):.3f}) | {share:.1f} |")


if __name__ == "__main__":
    main()
