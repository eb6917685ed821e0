"""SwiGLU forward + backward at Qwen3-8B shapes: eager, torch.compile, Liger-Kernel, d9d.

Run: python packages/d9d-kernels/benchmarks/bench_swiglu.py --out DIR   (add --smoke on CPU)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _harness import Result, Settings, attempt, copy_bandwidth_gbs, liger_functional, parse_settings, report

from d9d.kernels import KernelBackend, swiglu


def eager_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def run(settings: Settings) -> list[Result]:
    tokens, inter = (64, 96) if settings.smoke else (16384, 12288)
    dev, dtype = settings.device, torch.bfloat16
    gate = torch.randn(tokens, inter, device=dev, dtype=dtype, requires_grad=True)
    up = torch.randn(tokens, inter, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, inter, device=dev, dtype=dtype)

    def step(act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def fn() -> None:
            gate.grad = up.grad = None
            act(gate, up).backward(dy)

        return fn

    compiled = torch.compile(eager_swiglu)

    def liger() -> Callable[[], object]:
        functional: Any = liger_functional()
        return step(functional.liger_swiglu)

    backend = KernelBackend.REFERENCE if settings.smoke else KernelBackend.AUTO
    results = [
        attempt("eager", lambda: step(eager_swiglu), dev),
        attempt("torch.compile", lambda: step(compiled), dev),
        attempt("liger", liger, dev) if not settings.smoke else Result(name="liger", ms=None, peak_gib=None),
        attempt("d9d", lambda: step(lambda g, u: swiglu(g, u, backend=backend)), dev),
    ]
    copy = copy_bandwidth_gbs(dev)
    # Minimum traffic: forward reads gate, up, writes out; backward reads dy, gate, up, writes two grads.
    bytes_moved = 8 * tokens * inter * gate.element_size()
    for r in results:
        if r.ms is not None:
            r.extra["GB/s"] = bytes_moved / (r.extra.get("GPU ms", r.ms) * 1e-3) / 1e9
            r.extra["% copy BW"] = 100 * r.extra["GB/s"] / copy
    header = {"shape": f"gate, up ({tokens}, {inter}) bf16", "copy bandwidth GB/s": round(copy, 1)}
    report("swiglu", results, settings, header)
    return results


if __name__ == "__main__":
    run(parse_settings(__doc__ or ""))
