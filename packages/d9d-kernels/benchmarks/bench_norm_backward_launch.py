"""Launch choices of the norm backward kernels and the LM head's chunk size, at Gemma-3-1B widths.

GPU kernel time (``triton.testing.do_bench``) on one GPU, bf16, 16384 tokens:

- the backward kernels of ``rms_norm_add`` (with and without the next norm) and ``rms_norm`` over
  rows, tile rows and persistent programs per multiprocessor, at hidden 1152 and 2560, with the
  bandwidth each reaches and whether its outputs match the current launch's;
- the head's three matmuls per chunk of tokens (logits, hidden gradient, weight gradient) and the
  whole chunked linear cross-entropy per chunk size, at vocab 262144;
- scaling the head's weight gradient by a device scalar (``mul_`` against ``scale_in_place``) and
  summing per-program weight-gradient partials (``sum`` against ``sum_partials``).

Run: python packages/d9d-kernels/benchmarks/bench_norm_backward_launch.py [--widths 1152 2048 ...] [--no-head]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import triton
from _harness import gpu_us, outputs_close

from d9d.kernels._triton import norm_add_kernels, rms_norm_kernels
from d9d.kernels._triton.launch import next_power_of_2
from d9d.kernels._triton.linear_cross_entropy_kernels import linear_cross_entropy_forward, scale_in_place
from d9d.kernels._triton.rms_norm_kernels import NormBackwardKernel, backward_launch, sum_partials

TOKENS = 16384
VOCAB = 262144
BF16 = torch.bfloat16
Outputs = tuple[torch.Tensor | None, ...]


def sweep_norm_backward(cols: int, grid: list[tuple[int, int, int]]) -> None:
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    block = next_power_of_2(cols)
    dtotal, dy, total, branch, x = (torch.randn(TOKENS, cols, device=device, dtype=BF16) for _ in range(5))
    w1, w2 = (torch.randn(cols, device=device, dtype=BF16) * 0.1 for _ in range(2))
    rstd_branch, rstd_total = (torch.rand(TOKENS, device=device) + 0.5 for _ in range(2))

    def norm_add(
        has_next: bool, rows: int, warps: int, per_sm: int
    ) -> tuple[float, tuple[torch.Tensor | None, ...]]:
        dres, dbranch = torch.empty_like(dtotal), torch.empty_like(branch)
        tiles = triton.cdiv(TOKENS, rows)
        programs = min(tiles, sms * per_sm)
        partials = torch.empty((2, programs, cols), device=device)
        kernel = norm_add_kernels._norm_add_backward_kernel

        def run() -> None:
            kernel[(programs,)](
                dtotal, dy, total, branch, w1, w2, rstd_branch, rstd_total, dres, dbranch, partials[0],
                partials[1], branch.stride(0), TOKENS, cols, triton.cdiv(tiles, programs), 1.0,
                ZERO_CENTERED_BRANCH=True, ZERO_CENTERED_NEXT=True, SCALED=False, HAS_NEXT=has_next,
                ROWS=rows, BLOCK=block, num_warps=warps,
            )  # fmt: skip

        us = gpu_us(run)
        return us, (dres, dbranch, partials[0].sum(0), partials[1].sum(0) if has_next else None)

    def plain(rows: int, warps: int, per_sm: int) -> tuple[float, Outputs]:
        dx = torch.empty_like(x)
        tiles = triton.cdiv(TOKENS, rows)
        programs = min(tiles, sms * per_sm)
        partial = torch.empty((programs, cols), device=device)
        kernel = rms_norm_kernels._rms_norm_backward_kernel

        def run() -> None:
            kernel[(programs,)](
                dy, x, w1, rstd_branch, dx, partial, cols, cols, cols, TOKENS, cols,
                triton.cdiv(tiles, programs), ZERO_CENTERED=True, ROWS=rows, BLOCK=block, num_warps=warps,
            )  # fmt: skip

        return gpu_us(run), (dx, partial.sum(0))

    # (printed name, the kernel's launch in the table, bf16 tensors moved per element, runner)
    kernels: list[tuple[str, NormBackwardKernel, int, Callable[[int, int, int], tuple[float, Outputs]]]] = [
        ("rms_norm_add, next norm", "rms_norm_add_next", 6, lambda r, w, p: norm_add(True, r, w, p)),
        ("rms_norm_add", "rms_norm_add", 4, lambda r, w, p: norm_add(False, r, w, p)),
        ("rms_norm", "rms_norm", 3, plain),
    ]
    for name, kernel, moved, runner in kernels:
        launch = backward_launch(kernel, block)
        current = (launch.rows, launch.warps, launch.programs_per_sm)
        current_us, reference = runner(*current)
        results = []
        for rows, warps, per_sm in grid:
            us, outputs = runner(rows, warps, per_sm)
            results.append((us, rows, warps, per_sm, outputs_close(outputs, reference)))
        tb_s = moved * TOKENS * cols * 2 / 1e6
        print(
            f"{name}, hidden {cols}: now (rows, warps, per SM) {current}: "
            f"{current_us:.1f} us, {tb_s / current_us:.2f} TB/s"
        )
        for us, rows, warps, per_sm, same in sorted(results)[:6]:
            print(
                f"  rows {rows} warps {warps:2d} per SM {per_sm:2d}: "
                f"{us:7.1f} us {tb_s / us:.2f} TB/s same={same}"
            )


def head_products(hidden: torch.Tensor, weight: torch.Tensor, rows: int) -> None:
    h = hidden[:rows]
    logits = torch.empty(rows, VOCAB, device=hidden.device, dtype=BF16)
    dh = torch.empty(rows, hidden.shape[1], device=hidden.device, dtype=BF16)
    dw = torch.empty_like(weight)
    tflop = 2 * rows * hidden.shape[1] * VOCAB / 1e6
    times = (
        gpu_us(lambda: torch.mm(h, weight.T, out=logits)),
        gpu_us(lambda: torch.mm(logits, weight, out=dh)),
        gpu_us(lambda: dw.addmm_(logits.T, h)),
    )
    rates = " / ".join(f"{tflop / t:.0f}" for t in times)
    print(f"head, {rows} tokens a chunk: logits / hidden grad / weight grad {rates} TFLOPS")


def head() -> None:
    device = torch.device("cuda")
    hidden = torch.randn(TOKENS, 1152, device=device, dtype=BF16) * 0.05
    weight = torch.randn(VOCAB, 1152, device=device, dtype=BF16) * 0.02
    labels = torch.randint(0, VOCAB, (TOKENS,), device=device)
    scale = torch.ones(1, device=device) / TOKENS
    for rows in (1024, 2048, 4096, 8192):
        head_products(hidden, weight, rows)
    for chunk in (0, 2048, 4096, 8192):

        def loss(chunk: int = chunk) -> object:
            return linear_cross_entropy_forward(hidden, weight, labels, -100, scale, True, True, chunk)

        print(
            f"linear cross-entropy with gradients, chunk {chunk or 'default'}: {gpu_us(loss) / 1000:.2f} ms"
        )
    grad = torch.randn(VOCAB, 1152, device=device, dtype=BF16)
    factor = torch.full((1,), 0.5, device=device, dtype=BF16)
    mul_us, ours_us = gpu_us(lambda: grad.mul_(factor)), gpu_us(lambda: scale_in_place(grad, factor))
    print(f"head gradient times a device scalar: mul_ {mul_us:.1f} us, scale_in_place {ours_us:.1f} us")
    for programs in (264, 528, 1056):
        partials = torch.randn(2, programs, 1152, device=device)

        def summed(partials: torch.Tensor = partials) -> object:
            return [partials[i].sum(0).to(BF16) for i in range(2)]

        def ours(partials: torch.Tensor = partials) -> object:
            return sum_partials(partials, (BF16, BF16))

        print(
            f"two weight gradients from {programs} partials: "
            f"sum + cast {gpu_us(summed):.1f} us, sum_partials {gpu_us(ours):.1f} us"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[1152, 2560], help="hidden sizes to sweep")
    parser.add_argument("--no-head", action="store_true", help="skip the LM head's timings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm_backward_launch needs a CUDA GPU")
    print(torch.cuda.get_device_name())
    if not args.no_head:
        head()
    for cols in args.widths:
        sweep_norm_backward(cols, list(itertools.product((1, 2, 4), (4, 8, 16), (2, 4, 8))))


if __name__ == "__main__":
    main()
