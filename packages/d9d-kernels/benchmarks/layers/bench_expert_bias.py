"""Expert biases (GPT-OSS): d9d's one-hot matmul against a per-row gather, forward + backward.

``GroupedExperts(bias=True)`` adds each row's expert bias to the gate, up and down projections.
The gather (``repeat_interleave`` of the bias table, as d9d did before) has a backward that adds
every row into its expert's bias with atomics (``index_add``); d9d multiplies a one-hot of the
rows' experts with the bias table, so the bias gradient is one dense matmul. Both run the three
bias adds of one layer (widths ``I, I, H``) on the same rows; the table gives the median of
``--repeats`` alternating rounds (each the mean of 10 calls after 3 warm-ups) with its range.

GPU (GPT-OSS-20B widths: 4 x 4096 tokens, top-4 of 32 experts, H = I = 2880, bf16 rows, float32
biases):
    PYTHONPATH=packages/d9d-kernels/src python3 packages/d9d-kernels/benchmarks/layers/bench_expert_bias.py
CPU smoke run:
    uv run packages/d9d-kernels/benchmarks/layers/bench_expert_bias.py --smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from d9d.kernels.layers._grouped_experts import _add_bias, _experts_of_rows


def _gather_add(rows: torch.Tensor, bias: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    per_row = torch.repeat_interleave(bias, tokens_per_expert, dim=0, output_size=rows.shape[0])
    return rows + per_row.to(rows.dtype)


def _time_ms(step: Callable[[], object], device: torch.device, iters: int = 10) -> float:
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    rows_count, experts, hidden, intermediate = (256, 4, 32, 48) if args.smoke else (65536, 32, 2880, 2880)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    generator = torch.Generator(device="cpu").manual_seed(0)
    split = torch.multinomial(torch.ones(experts), rows_count, replacement=True, generator=generator)
    tokens_per_expert = torch.bincount(split, minlength=experts).to(device)
    widths = (intermediate, intermediate, hidden)
    rows = [torch.randn(rows_count, w, device=device, dtype=dtype, requires_grad=True) for w in widths]
    biases = [torch.randn(experts, w, device=device, requires_grad=True) for w in widths]

    def d9d_step() -> None:
        one_hot = _experts_of_rows(rows[0], tokens_per_expert)
        outs = [_add_bias(r, b, one_hot) for r, b in zip(rows, biases, strict=True)]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    def gather_step() -> None:
        outs = [_gather_add(r, b, tokens_per_expert) for r, b in zip(rows, biases, strict=True)]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    grads = []
    for step in (d9d_step, gather_step):
        for t in biases:
            t.grad = None
        step()
        grads.append([b.grad.clone() for b in biases if b.grad is not None])
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-2 * rows_count**0.5)
    times: dict[str, list[float]] = {"d9d (one-hot matmul)": [], "gather (index_add backward)": []}
    for _ in range(args.repeats):
        times["d9d (one-hot matmul)"].append(_time_ms(d9d_step, device))
        times["gather (index_add backward)"].append(_time_ms(gather_step, device))
    baseline = statistics.median(times["gather (index_add backward)"])
    print(f"device={device} rows={rows_count} experts={experts} widths={widths} dtype={dtype}")
    print("| implementation | fwd+bwd ms, median (min-max) | vs gather |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} ({min(values):.3f}-{max(values):.3f}) | {baseline / median:.2f}x |")


if __name__ == "__main__":
    main()
