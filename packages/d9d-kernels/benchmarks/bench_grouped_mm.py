"""grouped_mm at MoE shapes (64 experts, hidden 2048, intermediate 768, 32k routed tokens).

Compares against the dense bf16 matmul rate measured in the same run. Implementations: an eager
per-expert loop, torch.compile of that loop, d9d (PyTorch's grouped GEMM on sm90), and d9d's
Triton grouped GEMM forced. Liger-Kernel has no grouped GEMM.

Run: python packages/d9d-kernels/benchmarks/bench_grouped_mm.py --out DIR   (--smoke on CPU)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from _harness import Result, Settings, attempt, dense_matmul_tflops, parse_settings, report

from d9d.kernels import KernelBackend, grouped_mm


def eager_loop(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return torch.cat([chunk @ weight[g] for g, chunk in enumerate(torch.split(x, sizes))])


def run(settings: Settings) -> list[Result]:
    experts, hidden, inter, routed = (4, 32, 48, 200) if settings.smoke else (64, 2048, 768, 32768)
    dev, dtype = settings.device, torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    # Uneven loads, as from a router: multinomial draws around the mean.
    counts = torch.bincount(torch.randint(0, experts, (routed,), generator=generator), minlength=experts)
    sizes = [int(c) for c in counts]
    tokens = counts.to(dev)
    x = (torch.randn(routed, hidden, device=dev, dtype=dtype)).requires_grad_()
    w = (torch.randn(experts, hidden, inter, device=dev, dtype=dtype) * hidden**-0.5).requires_grad_()
    dy = torch.randn(routed, inter, device=dev, dtype=dtype)

    def forward(mm: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def fn() -> None:
            with torch.no_grad():
                mm()

        return fn

    def train(mm: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def fn() -> None:
            x.grad = w.grad = None
            mm().backward(dy)

        return fn

    compiled = torch.compile(eager_loop)
    impls: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("eager loop", lambda: eager_loop(x, w, sizes)),
        ("torch.compile loop", lambda: compiled(x, w, sizes)),
        ("d9d (auto)", lambda: grouped_mm(x, w, tokens)),
        (
            "d9d (triton)",
            lambda: grouped_mm(
                x, w, tokens, backend=KernelBackend.TRITON if not settings.smoke else KernelBackend.REFERENCE
            ),
        ),
    ]
    results: list[Result] = []
    for name, mm in impls:
        fwd = attempt(f"{name} fwd", lambda mm=mm: forward(mm), dev)
        fwd.extra["TFLOP/s"] = 2 * routed * hidden * inter / (fwd.ms * 1e-3) / 1e12 if fwd.ms else 0.0
        both = attempt(f"{name} fwd+bwd", lambda mm=mm: train(mm), dev)
        both.extra["TFLOP/s"] = 3 * 2 * routed * hidden * inter / (both.ms * 1e-3) / 1e12 if both.ms else 0.0
        results += [fwd, both]
    dense_peak = dense_matmul_tflops(dev)
    dense_same = dense_matmul_tflops(dev, routed, inter, hidden) if not settings.smoke else dense_peak
    for r in results:
        r.extra["% dense peak"] = 100 * r.extra["TFLOP/s"] / dense_peak
    header = {
        "shape": f"{experts} experts, x ({routed}, {hidden}), weight ({experts}, {hidden}, {inter}) bf16, "
        f"tokens per expert {min(sizes)}..{max(sizes)}",
        "dense bf16 matmul TFLOP/s (8192^3)": round(dense_peak, 1),
        f"dense bf16 matmul TFLOP/s ({routed}x{hidden}x{inter})": round(dense_same, 1),
    }
    report("grouped_mm", results, settings, header)
    return results


if __name__ == "__main__":
    run(parse_settings(__doc__ or ""))
