"""Each context-parallel rank's attention work against one GPU's whole attention, on one GPU.

Run:  python packages/d9d-parallel/benchmarks/context_parallel_attention.py [--seq 32768 --cp 2]

With the load-balanced layout a rank's causal attention is ``1 / cp`` of the whole sequence's,
so a rank should take ``1 / cp`` of one GPU's time. This times, per rank (its two chunks
``r`` and ``2 cp - 1 - r``, keys and values of the whole sequence already gathered, no
communication), the forward and backward of ``ContextParallelAttention``'s unmasked causal path
with each kernel choice, against SDPA's causal attention over the whole sequence:

- ``block kernel``: each chunk as a square causal block and an unmasked prefix on cuDNN, merged by
  log-sum-exp (the default on CUDA);
- ``lower-right bias``: each chunk under SDPA's lower-right ``CausalBias`` (FlashAttention-2), the
  fallback where no block kernel fits.

Qwen3-0.6B's attention (16 query heads, 8 key/value heads, head size 128), bf16, batch 1 by
default. Every figure is the median over ``--repeats`` alternating rounds (CUDA events around
``--iters`` back-to-back calls) with its range; ``ratio`` is the rank's time over one GPU's.
``--smoke`` runs tiny shapes on CPU (checks the script only).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from d9d.parallel import block_attention_kernel_for
from d9d.parallel._context_parallel_attention import _attend_unmasked

_Case = tuple[Callable[[], torch.Tensor], torch.Tensor]  # attention, and the gradient of its output


def _time_ms(fn: Callable[[], object], *, iters: int, cuda: bool) -> float:
    if not cuda:
        import time

        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--heads", type=int, nargs=2, default=(16, 8), metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also each rank's path under torch.compile")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.heads, args.head_dim, args.iters, args.repeats = 64, (4, 2), 8, 1, 1
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    (q_heads, kv_heads), dim, seq, cp = args.heads, args.head_dim, args.seq, args.cp
    scale = dim**-0.5

    def tensor(length: int, heads: int) -> torch.Tensor:
        return torch.randn(1, length, heads, dim, device=device, dtype=dtype, requires_grad=True)

    key, value, query = tensor(seq, kv_heads), tensor(seq, kv_heads), tensor(seq, q_heads)
    local_query = tensor(seq // cp, q_heads)
    grad, local_grad = torch.randn_like(query), torch.randn_like(local_query)

    def full() -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)

    block_kernel = block_attention_kernel_for(local_query)
    cases: dict[str, _Case] = {"one GPU, whole sequence": (full, grad)}
    for rank in range(cp):
        chunks = (rank, 2 * cp - 1 - rank)
        for label, kernel in (("block kernel", block_kernel), ("lower-right bias", None)):
            if label == "block kernel" and kernel is None:
                continue

            def rank_attention(chunks: tuple[int, int] = chunks, kernel: object = kernel) -> torch.Tensor:
                return _attend_unmasked(
                    local_query, key, value, causal=True, softmax_scale=scale, chunk_indices=chunks,
                    kernel=kernel,  # type: ignore[arg-type]
                )  # fmt: skip

            cases[f"rank {rank} (chunks {chunks}), {label}"] = (rank_attention, local_grad)
            if args.compile and kernel is not None:
                cases[f"rank {rank} (chunks {chunks}), {label}, compiled"] = (
                    torch.compile(rank_attention),
                    local_grad,
                )

    def step(fn: Callable[[], torch.Tensor], out_grad: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for t in (query, key, value, local_query):
                t.grad = None
            fn().backward(out_grad)

        return run

    steps = {name: step(fn, g) for name, (fn, g) in cases.items()}
    for run in steps.values():  # warm-up (and compilation)
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, run in steps.items():
            times[name].append(_time_ms(run, iters=args.iters, cuda=device.type == "cuda"))
    reference = times["one GPU, whole sequence"]
    print(f"seq {seq}, cp {cp}, heads {q_heads}/{kv_heads}, head size {dim}, {dtype}, {device}")
    print("| attention fwd+bwd | ms | ratio to one GPU (ideal 1/cp) |")
    print("|---|---|---|")
    for name, values in times.items():
        ratios = [v / r for v, r in zip(values, reference, strict=True)]
        print(f"| {name} | {_spread(values)} | {_spread(ratios)} |")


if __name__ == "__main__":
    main()
