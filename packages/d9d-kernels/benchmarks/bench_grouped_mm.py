"""grouped_mm at MoE shapes against a dense matmul of the same M x K x N, by GPU time.

Two shapes, each with uneven loads drawn as a router would: the 64-expert kernel shape (hidden
2048, intermediate 768, 32k routed rows, about 512 rows per expert) and the Qwen3-30B-A3B layer
of the MoE training benchmark (128 experts, 4 x 4096 tokens x top-8 = 131k rows, about 1024 per
expert), both the gate/up product (K=2048, N=768) and the down product (K=768, N=2048).
Implementations: an eager per-expert loop, torch.compile of that loop, d9d (PyTorch's grouped
GEMM on sm90) and d9d's Triton grouped GEMM forced. "% dense" divides the dense matmul's GPU time
(profiler kernel time, the same FLOPs) by the implementation's; wall time includes the host.
Liger-Kernel has no grouped GEMM.

Run: python packages/d9d-kernels/benchmarks/bench_grouped_mm.py --out DIR   (--smoke on CPU)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from _harness import Result, Settings, attempt, dense_matmul_tflops, parse_settings, report

from d9d.kernels import KernelBackend, grouped_mm


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    rows: int
    k: int
    n: int
    with_loops: bool = False  # the per-expert loops (slow to compile at 128 experts)


SHAPES = (
    Shape("64 experts, gate/up", 64, 32768, 2048, 768, with_loops=True),
    Shape("128 experts (Qwen3-30B-A3B, batch 4 x 4096), gate/up", 128, 131072, 2048, 768),
    Shape("128 experts (Qwen3-30B-A3B, batch 4 x 4096), down", 128, 131072, 768, 2048),
)
SMOKE_SHAPES = (Shape("smoke", 4, 200, 32, 48, with_loops=True),)


def eager_loop(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return torch.cat([chunk @ weight[g] for g, chunk in enumerate(torch.split(x, sizes))])


def run_shape(shape: Shape, settings: Settings) -> list[Result]:
    dev, dtype = settings.device, torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    # Uneven loads, as from a router: multinomial draws around the mean.
    counts = torch.bincount(
        torch.randint(0, shape.experts, (shape.rows,), generator=generator), minlength=shape.experts
    )
    sizes = [int(c) for c in counts]
    tokens = counts.to(dev)
    x = torch.randn(shape.rows, shape.k, device=dev, dtype=dtype).requires_grad_()
    std = shape.k**-0.5
    w = (torch.randn(shape.experts, shape.k, shape.n, device=dev, dtype=dtype) * std).requires_grad_()
    dense_w = (torch.randn(shape.k, shape.n, device=dev, dtype=dtype) * shape.k**-0.5).requires_grad_()
    dy = torch.randn(shape.rows, shape.n, device=dev, dtype=dtype)

    def forward(mm: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def fn() -> None:
            with torch.no_grad():
                mm()

        return fn

    def train(mm: Callable[[], torch.Tensor]) -> Callable[[], object]:
        def fn() -> None:
            x.grad = w.grad = dense_w.grad = None
            mm().backward(dy)

        return fn

    compiled = torch.compile(eager_loop)
    triton = KernelBackend.TRITON if not settings.smoke else KernelBackend.REFERENCE
    loops: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("eager loop", lambda: eager_loop(x, w, sizes)),
        ("torch.compile loop", lambda: compiled(x, w, sizes)),
    ]
    impls: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("dense matmul, same M x K x N", lambda: x @ dense_w),
        *(loops if shape.with_loops else []),
        ("d9d (auto)", lambda: grouped_mm(x, w, tokens)),
        ("d9d (triton)", lambda: grouped_mm(x, w, tokens, backend=triton)),
    ]
    flops = 2 * shape.rows * shape.k * shape.n
    results: list[Result] = []
    dense: dict[str, float] = {}
    for name, mm in impls:
        for kind, factory, matmuls in (("fwd", forward, 1), ("fwd+bwd", train, 3)):
            result = attempt(f"{shape.name}: {name} {kind}", lambda mm=mm, factory=factory: factory(mm), dev)
            gpu_ms = result.extra.get("GPU ms", result.ms)
            if gpu_ms:
                result.extra["TFLOP/s (GPU time)"] = matmuls * flops / (gpu_ms * 1e-3) / 1e12
                if name.startswith("dense"):
                    dense[kind] = gpu_ms
                elif kind in dense:
                    result.extra["% dense"] = 100 * dense[kind] / gpu_ms
            results.append(result)
            print(f"{result.name}: GPU {gpu_ms} ms, {result.extra}", flush=True)
    return results


def run(settings: Settings) -> list[Result]:
    shapes = SMOKE_SHAPES if settings.smoke else SHAPES
    results = [r for shape in shapes for r in run_shape(shape, settings)]
    header = {
        "shapes": "; ".join(
            f"{s.name}: x ({s.rows}, {s.k}), weight ({s.experts}, {s.k}, {s.n}) bf16" for s in SHAPES
        ),
        "dense bf16 matmul TFLOP/s (8192^3, wall)": round(dense_matmul_tflops(settings.device), 1),
    }
    report("grouped_mm", results, settings, header)
    return results


if __name__ == "__main__":
    run(parse_settings(__doc__ or ""))
