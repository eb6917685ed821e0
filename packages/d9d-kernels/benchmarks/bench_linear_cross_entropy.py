"""Linear cross-entropy forward + backward at Qwen3-8B shapes: eager, torch.compile, Liger, d9d.

Run: python packages/d9d-kernels/benchmarks/bench_linear_cross_entropy.py --out DIR   (--smoke on CPU)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _harness import Result, Settings, attempt, liger_functional, parse_settings, report

from d9d.kernels import KernelBackend, linear_cross_entropy


def eager_lce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100)


def run(settings: Settings) -> list[Result]:
    tokens, hidden, vocab = (64, 32, 1000) if settings.smoke else (16384, 4096, 151936)
    dev, dtype = settings.device, torch.bfloat16
    h = (torch.randn(tokens, hidden, device=dev, dtype=dtype) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, device=dev, dtype=dtype) * hidden**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=dev)
    labels[::10] = -100

    def step(
        loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> Callable[[], object]:
        def fn() -> None:
            h.grad = w.grad = None
            loss_fn(h, w, labels).backward()

        return fn

    compiled = torch.compile(eager_lce)

    def liger() -> Callable[[], object]:
        functional: Any = liger_functional()
        return step(functional.liger_fused_linear_cross_entropy)

    backend = KernelBackend.REFERENCE if settings.smoke else KernelBackend.AUTO
    iters = {"warmup": 2, "iters": 5}
    results = [
        attempt("eager", lambda: step(eager_lce), dev, **iters),
        attempt("torch.compile", lambda: step(compiled), dev, **iters),
        attempt("liger", liger, dev, **iters)
        if not settings.smoke
        else Result(name="liger", ms=None, peak_gib=None),
        attempt(
            "d9d", lambda: step(lambda h, w, y: linear_cross_entropy(h, w, y, backend=backend)), dev, **iters
        ),
    ]
    eager = results[0]
    for r in results:
        if r.ms is not None and eager.ms is not None and eager.peak_gib:
            r.extra["time / eager"] = r.ms / eager.ms
            r.extra["memory / eager"] = (r.peak_gib or 0.0) / eager.peak_gib
    flops = 3 * 2 * tokens * hidden * vocab
    for r in results:
        if r.ms is not None:
            r.extra["TFLOP/s (3 matmuls)"] = flops / (r.ms * 1e-3) / 1e12
    header = {"shape": f"hidden ({tokens}, {hidden}), weight ({vocab}, {hidden}) bf16, 10% ignored labels"}
    report("linear_cross_entropy", results, settings, header)
    return results


if __name__ == "__main__":
    run(parse_settings(__doc__ or ""))
