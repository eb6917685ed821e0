"""MoE experts in FP8 (``Float8GroupedMatmul``) against bf16 ``grouped_mm``, one GPU.

Run:  python packages/d9d-parallel/benchmarks/float8_experts.py [--tokens 16384 65536] [--profile]

Qwen3-30B-A3B's experts: hidden 2048, 128 experts, top-8, expert width 768; ``--tokens`` tokens
routed (``tokens x 8`` rows, multinomial loads as from a router). Each row times one forward and
backward of d9d-kernels' ``GroupedSwiGLUExperts`` (bf16 weights, as FSDP's mixed precision hands
them to the layer), eager and under ``torch.compile``: bf16 ``grouped_mm``, d9d's
``Float8GroupedMatmul`` (forward and input gradient in FP8, weight gradient bf16; ``d9d fp8``
as ``convert_experts_to_float8`` installs it, the gate and up products as one pair sharing the
cast of their input, ``d9d fp8 unpaired`` with three separate products) and, where
torchao is installed, torchao's all-FP8 grouped GEMM (the one torchtitan's float8 MoE converter
uses). Ratios are medians of ``--repeats`` alternating rounds, with their range. ``--profile``
prints the GPU kernels of one d9d FP8 step.

``--microbatches N`` times steps of N forwards and backwards (gradient accumulation) and adds
``d9d fp8 kept casts``: the same FP8 experts with ``Float8WeightCasts``, which casts the weights
in a step's first microbatch and reads those casts in the others (cleared after every step, as
``model.float8.expert_weight_casts: per_step`` does after each optimizer step).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from d9d.kernels.layers import GroupedSwiGLUExperts
from d9d.parallel import Float8GroupedMatmul, Float8WeightCasts, GroupedMatmul, convert_experts_to_float8

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768


def _step_ms(step: Callable[[], None], iters: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


class _TorchaoGroupedMatmul:
    """torchao's all-FP8 grouped GEMM (weight gradient in FP8 too), as torchtitan's converter runs
    it; needs every group a multiple of 16 rows, which the benchmark's loads are."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        ends = torch.cumsum(tokens_per_group, dim=0, dtype=torch.int32)
        column_major = weight.transpose(-2, -1).contiguous().transpose(-2, -1)
        fp8 = torch.float8_e4m3fn
        return _to_fp8_rowwise_then_scaled_grouped_mm(x, column_major, ends, x.dtype, fp8, False)


def _rows(tokens: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows = tokens * TOP_K
    # multinomial loads as from a router, rounded to multiples of 16 rows so torchao's kernel runs
    counts = torch.bincount(torch.randint(0, EXPERTS, (rows,)), minlength=EXPERTS) // 16 * 16
    rows = int(counts.sum())
    counts = counts.to(device)
    tokens_in = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)

    def layer(name: str, weight_casts: Float8WeightCasts) -> GroupedSwiGLUExperts:
        experts = GroupedSwiGLUExperts(EXPERTS, HIDDEN, WIDTH).to(device=device, dtype=torch.bfloat16)
        if name == "d9d fp8":
            convert_experts_to_float8(experts)
        elif name == "d9d fp8 kept casts":
            convert_experts_to_float8(experts, weight_casts)
        elif matmuls[name] is not None:
            experts.grouped_matmul = matmuls[name]
        return experts

    def step_of(
        module: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weight_casts: Float8WeightCasts
    ) -> Callable[[], None]:
        def step() -> None:
            for _ in range(args.microbatches):  # gradients accumulate in the weights
                tokens_in.grad = None
                module(tokens_in, counts).backward(upstream)
            weight_casts.clear()  # the optimizer step would change the weights here

        return step

    matmuls: dict[str, GroupedMatmul | None] = {
        "bf16": None,
        "d9d fp8": None,  # installed by convert_experts_to_float8
        "d9d fp8 unpaired": Float8GroupedMatmul(),
    }
    if args.microbatches > 1:
        matmuls["d9d fp8 kept casts"] = None  # installed by convert_experts_to_float8
    if importlib.util.find_spec("torchao") is not None:
        matmuls["torchao fp8"] = _TorchaoGroupedMatmul()
    steps: dict[str, Callable[[], None]] = {}
    for mode in ("eager", "compile"):
        for name in matmuls:
            weight_casts = Float8WeightCasts()
            module = layer(name, weight_casts)
            compiled = torch.compile(module) if mode == "compile" else module
            steps[f"{name} {mode}"] = step_of(compiled, weight_casts)
    flops = 3 * 3 * 2 * rows * HIDDEN * WIDTH * args.microbatches
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(_step_ms(step, args.iters))
    print(
        f"\nexperts {EXPERTS} x ({HIDDEN}, {WIDTH}), {tokens} tokens top-{TOP_K}: {rows} rows, "
        f"{args.microbatches} x fwd+bwd per step"
    )
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"({min(values):.2f}-{max(values):.2f})"
        print(f"{name:20s} {median:8.2f} ms  {flops / (median * 1e-3) / 1e12:7.1f} TFLOP/s  {spread}")
    for mode in ("eager", "compile"):
        for name in matmuls:
            if name == "bf16":
                continue
            ratios = [b / f for b, f in zip(times[f"bf16 {mode}"], times[f"{name} {mode}"], strict=True)]
            spread = f"({min(ratios):.3f}-{max(ratios):.3f})"
            print(f"{name} speed vs bf16, {mode}: {statistics.median(ratios):.3f}x {spread}")
        if args.microbatches > 1:
            kept, per_call = times[f"d9d fp8 kept casts {mode}"], times[f"d9d fp8 {mode}"]
            ratios = [c / k for c, k in zip(per_call, kept, strict=True)]
            spread = f"({min(ratios):.3f}-{max(ratios):.3f})"
            print(f"d9d fp8 kept casts speed vs d9d fp8, {mode}: {statistics.median(ratios):.3f}x {spread}")
    if args.profile:
        for name in ("d9d fp8 compile",):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                steps[name]()
                torch.cuda.synchronize()
            print(f"--- {name}: GPU kernels of one step")
            averages = prof.key_averages()
            print(averages.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=90))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--microbatches", type=int, default=1)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for tokens in args.tokens:
        _rows(tokens, args)


if __name__ == "__main__":
    main()
