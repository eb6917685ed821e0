"""RoPE forward + backward on queries and keys at Qwen3-8B shapes: eager, torch.compile, Liger, d9d.

Run: python packages/d9d-kernels/benchmarks/bench_rope.py --out DIR   (--smoke on CPU)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _harness import Result, Settings, attempt, copy_bandwidth_gbs, liger_functional, parse_settings, report

from d9d.kernels import KernelBackend, apply_rope


def eager_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def run(settings: Settings) -> list[Result]:
    batch, seq, q_heads, kv_heads, head_dim = (1, 16, 4, 2, 16) if settings.smoke else (1, 16384, 32, 8, 128)
    dev, dtype = settings.device, torch.bfloat16
    q = torch.randn(batch, seq, q_heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seq, kv_heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
    freqs = torch.randn(batch, seq, head_dim // 2, device=dev)
    angles = torch.cat((freqs, freqs), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def step(
        rope: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> Callable[[], object]:
        def fn() -> None:
            q.grad = k.grad = None
            rq, rk = rope(q, k)
            torch.autograd.backward([rq, rk], [dq, dk])

        return fn

    compiled = torch.compile(eager_rope)

    def liger() -> Callable[[], object]:
        functional: Any = liger_functional()

        def rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # Liger wants (batch, heads, seq, head_dim); transposing outside is part of its cost here.
            rq, rk = functional.liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return rq.transpose(1, 2), rk.transpose(1, 2)

        return step(rope)

    backend = KernelBackend.REFERENCE if settings.smoke else KernelBackend.AUTO
    results = [
        attempt("eager", lambda: step(lambda q, k: (eager_rope(q, cos, sin), eager_rope(k, cos, sin))), dev),
        attempt(
            "torch.compile", lambda: step(lambda q, k: (compiled(q, cos, sin), compiled(k, cos, sin))), dev
        ),
        attempt("liger", liger, dev) if not settings.smoke else Result(name="liger", ms=None, peak_gib=None),
        attempt(
            "d9d",
            lambda: step(
                lambda q, k: (
                    apply_rope(q, cos, sin, backend=backend),
                    apply_rope(k, cos, sin, backend=backend),
                )
            ),
            dev,
        ),
    ]
    copy = copy_bandwidth_gbs(dev)
    bytes_moved = 4 * (q.numel() + k.numel()) * q.element_size()  # read + write, forward and backward
    for r in results:
        if r.ms is not None:
            r.extra["GB/s"] = bytes_moved / (r.extra.get("GPU ms", r.ms) * 1e-3) / 1e9
            r.extra["% copy BW"] = 100 * r.extra["GB/s"] / copy
    header = {
        "shape": f"q ({batch}, {seq}, {q_heads}, {head_dim}), k ({kv_heads} heads) bf16",
        "copy bandwidth GB/s": round(copy, 1),
    }
    report("rope", results, settings, header)
    return results


if __name__ == "__main__":
    run(parse_settings(__doc__ or ""))
