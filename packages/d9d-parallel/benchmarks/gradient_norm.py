"""The gradient norm's reduction: torch's multi-tensor norm against one kernel per large tensor.

Run:  python packages/d9d-parallel/benchmarks/gradient_norm.py   (--smoke on CPU)

``clip_grad_norm`` / ``gradient_clip`` sum ``|g|^p`` over every gradient. torch's multi-tensor
norm (``_foreach_norm``) cuts tensors into chunks of 64K elements and covers a few hundred chunks
per launch, which suits many small tensors; a large tensor is read faster by one reduction of its
own. This times, on bf16 gradients of Qwen3-0.6B (310 tensors) and of six Qwen3-30B-A3B layers
(72 tensors, 3.7B elements), the sum of squares computed all by the multi-tensor norm, by one
kernel per tensor, and split at several sizes (d9d splits at 2**24 elements). Every figure is the
median over ``--repeats`` alternating rounds (CUDA events around ``--iters`` back-to-back calls)
with its range, and the share of the copy bandwidth it reaches.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from d9d.parallel._grad_norm import _sum_of_powers  # pyright: ignore[reportPrivateUsage]


def _attention_and_norm_shapes(
    hidden: int, heads: int, kv_heads: int, head_dim: int
) -> list[tuple[int, ...]]:
    """A Qwen3 decoder layer's q, k, v, o projections, q/k norms and its two RMSNorms."""
    projections = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden)]
    return [*projections, (hidden, heads * head_dim), (head_dim,), (head_dim,), (hidden,), (hidden,)]


def qwen3_dense_shapes() -> list[tuple[int, ...]]:
    """Qwen3-0.6B's parameter shapes (tied embedding)."""
    hidden, ffn, layers, vocab = 1024, 3072, 28, 151936
    layer = [*_attention_and_norm_shapes(hidden, 16, 8, 128), (ffn, hidden), (ffn, hidden), (hidden, ffn)]
    return [(vocab, hidden), *(layer * layers), (hidden,)]


def qwen3_moe_layer_shapes(layers: int) -> list[tuple[int, ...]]:
    """``layers`` decoder layers at Qwen3-30B-A3B widths (128 experts of 768, hidden 2048)."""
    hidden, experts, ffn = 2048, 128, 768
    experts_shapes = [
        (experts, hidden),
        (experts, ffn, hidden),
        (experts, ffn, hidden),
        (experts, hidden, ffn),
    ]
    return [*_attention_and_norm_shapes(hidden, 32, 4, 128), *experts_shapes] * layers


def _copy_bandwidth_gbs(device: str) -> float:
    source = torch.empty(1 << 28, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    return 2 * source.numel() * 2 / (_time_ms(lambda: target.copy_(source), device, 10) * 1e-3) / 1e9


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


SPLITS = {
    "multi-tensor norm only": 1 << 62,
    "one kernel per tensor": 1,
    "split at 2**20": 1 << 20,
    "split at 2**22": 1 << 22,
    "split at 2**24 (d9d)": 1 << 24,
}


def _split_times(
    shapes: list[tuple[int, ...]], device: str, repeats: int, iters: int
) -> dict[str, list[float]]:
    grads = [torch.randn(shape, device=device).to(torch.bfloat16) for shape in shapes]
    expected = _sum_of_powers(grads, 2.0, 1 << 62)
    for split in SPLITS.values():
        torch.testing.assert_close(_sum_of_powers(grads, 2.0, split), expected, rtol=1e-4, atol=0.0)
    times: dict[str, list[float]] = {name: [] for name in SPLITS}
    for _ in range(repeats):
        for name, split in SPLITS.items():
            times[name].append(_time_ms(lambda split=split: _sum_of_powers(grads, 2.0, split), device, iters))
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
    lists = {"Qwen3-0.6B": qwen3_dense_shapes(), "6 Qwen3-30B-A3B layers": qwen3_moe_layer_shapes(6)}
    if args.smoke:
        lists = {"tiny": [(64, 32), (8,), (3, 16, 8)]}
    bandwidth = _copy_bandwidth_gbs(device)
    print(f"copy bandwidth {bandwidth:.0f} GB/s")
    for list_name, shapes in lists.items():
        times = _split_times(shapes, device, args.repeats, args.iters)
        elements = sum(torch.Size(shape).numel() for shape in shapes)
        print(f"\n{list_name}: {len(shapes)} tensors, {elements / 1e6:.0f}M bf16 gradients")
        print("| reduction | ms | % copy bandwidth |\n|---|---|---|")
        for name, values in times.items():
            median = statistics.median(values)
            share = 100 * 2 * elements / (median * 1e-3) / 1e9 / bandwidth
            print(f"| {name} | {median:.3f} ({min(values):.3f}-{max(values):.3f}) | {share:.1f} |")


if __name__ == "__main__":
    main()
