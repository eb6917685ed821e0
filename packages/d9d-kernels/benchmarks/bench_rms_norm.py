"""RMSNorm forward + backward at Qwen3-8B shapes: eager, torch.compile, Liger-Kernel, d9d.

Run: python packages/d9d-kernels/benchmarks/bench_rms_norm.py --out DIR   (add --smoke on CPU)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _harness import Result, Settings, attempt, copy_bandwidth_gbs, liger_functional, parse_settings, report

from d9d.kernels import KernelBackend, rms_norm


def eager_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def run(settings: Settings) -> list[Result]:
    tokens, hidden = (64, 96) if settings.smoke else (16384, 4096)
    dev, dtype = settings.device, torch.bfloat16
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype, requires_grad=True)
    w = torch.rand(hidden, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, hidden, device=dev, dtype=dtype)

    def step(norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def fn() -> None:
            x.grad = w.grad = None
            norm(x, w).backward(dy)

        return fn

    compiled = torch.compile(eager_rms_norm)

    def liger() -> Callable[[], object]:
        functional: Any = liger_functional()
        return step(lambda x, w: functional.liger_rms_norm(x, w, 1e-6))

    backend = KernelBackend.REFERENCE if settings.smoke else KernelBackend.AUTO
    results = [
        attempt("eager", lambda: step(lambda x, w: eager_rms_norm(x, w, 1e-6)), dev),
        attempt("torch.compile", lambda: step(lambda x, w: compiled(x, w, 1e-6)), dev),
        attempt("liger", liger, dev) if not settings.smoke else Result(name="liger", ms=None, peak_gib=None),
        attempt("d9d", lambda: step(lambda x, w: rms_norm(x, w, 1e-6, backend=backend)), dev),
    ]
    copy = copy_bandwidth_gbs(dev)
    # Minimum traffic: forward reads x, writes y; backward reads dy and x, writes dx.
    bytes_moved = 5 * tokens * hidden * x.element_size()
    for r in results:
        if r.ms is not None:
            r.extra["GB/s"] = bytes_moved / (r.extra.get("GPU ms", r.ms) * 1e-3) / 1e9
            r.extra["% copy BW"] = 100 * r.extra["GB/s"] / copy
    header = {"shape": f"x ({tokens}, {hidden}) bf16", "copy bandwidth GB/s": round(copy, 1)}
    report("rms_norm", results, settings, header)
    return results


if __name__ == "__main__":
    run(parse_settings(__doc__ or ""))
