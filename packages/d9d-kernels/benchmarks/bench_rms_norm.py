"""RMSNorm at Qwen3 shapes: GPU time forward and forward + backward against peers, and host overhead.

Shapes, bf16: Qwen3-0.6B's hidden norm (16384 tokens x 1024), its qk-norm over the query heads
(16384 x 16 heads, rows of 128) and Qwen3-8B's hidden norm (16384 x 4096). Peers: eager PyTorch,
torch.compile, Liger-Kernel. The host-overhead table times one call on a tiny input, where the host
is the bottleneck: d9d's eager path (an ``autograd.Function``) against its custom op (the path
taken under torch.compile), for RMSNorm, SwiGLU and RoPE. ``--sweep`` adds a sweep of d9d's tile
rows and persistent backward programs per multiprocessor (GPU kernel time only).

Run: python packages/d9d-kernels/benchmarks/bench_rms_norm.py --out DIR   (add --smoke on CPU)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _harness import (
    Result,
    Settings,
    attempt,
    copy_bandwidth_gbs,
    gpu_kernel_ms,
    liger_functional,
    parse_settings,
    report,
)

from d9d.kernels import KernelBackend, rms_norm

Norm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
EPS = 1e-6
# (label used in file names, rows, hidden) at full size and in --smoke
SHAPES = [
    ("rms_norm_qwen3_hidden_1024", 16384, 1024),
    ("rms_norm_qwen3_qk_norm_128", 16384 * 16, 128),
    ("rms_norm_qwen3_8b_hidden_4096", 16384, 4096),
]
SWEEP_PROGRAMS_PER_SM = (2, 4, 8)
SMOKE_SHAPES = [(label, 64, 96 if hidden > 128 else 16) for label, _, hidden in SHAPES]


def eager_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _implementations(settings: Settings) -> dict[str, Callable[[], Norm]]:
    """Factories of each implementation's norm; a factory raises where its implementation is missing."""
    backend = KernelBackend.REFERENCE if settings.smoke else KernelBackend.AUTO
    # One compiled function per shape: dynamic=False keeps a static-shape kernel for each.
    compiled = torch.compile(eager_rms_norm, dynamic=False)

    def liger() -> Norm:
        if settings.smoke:
            raise RuntimeError("skipped in --smoke")
        functional: Any = liger_functional()
        return lambda x, w: functional.liger_rms_norm(x, w, EPS)

    return {
        "eager": lambda: lambda x, w: eager_rms_norm(x, w, EPS),
        "torch.compile": lambda: lambda x, w: compiled(x, w, EPS),
        "liger": liger,
        "d9d": lambda: lambda x, w: rms_norm(x, w, EPS, backend=backend),
    }


def _bench_shape(settings: Settings, label: str, rows: int, hidden: int, copy: float) -> list[Result]:
    dev = settings.device
    x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)

    def step(norm: Norm) -> Callable[[], object]:
        def fn() -> None:
            x.grad = w.grad = None
            norm(x, w).backward(dy)

        return fn

    # Minimum traffic: forward reads x, writes y; backward reads dy and x, writes dx.
    forward_bytes, step_bytes = 2 * x.numel() * x.element_size(), 5 * x.numel() * x.element_size()
    results: list[Result] = []
    for name, factory in _implementations(settings).items():
        result = attempt(name, lambda factory=factory: step(factory()), dev)
        if result.ms is not None and dev == "cuda":
            norm = factory()
            result.extra["fwd GPU ms"] = gpu_kernel_ms(lambda norm=norm: norm(x, w))
            result.extra["fwd % copy BW"] = (
                100 * forward_bytes / (result.extra["fwd GPU ms"] * 1e-3) / 1e9 / copy
            )
            step_ms = result.extra.get("GPU ms", result.ms)
            result.extra["% copy BW"] = 100 * step_bytes / (step_ms * 1e-3) / 1e9 / copy
        results.append(result)
    header = {
        "shape": f"x ({rows}, {hidden}) bf16",
        "copy bandwidth GB/s": round(copy, 1),
        "columns": "GPU ms: forward + backward; fwd GPU ms: forward alone (training mode)",
    }
    report(label, results, settings, header)
    return results


def _host_us(fn: Callable[[], object], device: str, calls: int = 300) -> float:
    """Wall microseconds per call of ``fn`` in a loop; with tiny inputs, the host's cost per call."""
    for _ in range(20):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _host_row(name: str, forward: Callable[[], Callable[[], torch.Tensor]], device: str) -> Result:
    """Host microseconds of one forward, and of one forward + backward (sum of the output)."""
    try:
        fn = forward()
        fwd_us = _host_us(fn, device)
        step_us = _host_us(lambda: fn().sum().backward(), device)
        return Result(
            name=name, ms=step_us / 1e3, peak_gib=None, extra={"fwd us": fwd_us, "fwd+bwd us": step_us}
        )
    except Exception as error:  # a path that cannot run here must not stop the others
        return Result(name=name, ms=None, peak_gib=None, note=f"{type(error).__name__}: {error}"[:160])


def _host_overhead(settings: Settings) -> list[Result]:
    dev, dtype = settings.device, torch.bfloat16
    from d9d.kernels._triton import rms_norm_op, rope_op, swiglu_op  # also registers the custom ops

    ops: Any = torch.ops.d9d_kernels
    x = torch.randn(4, 128, device=dev, dtype=dtype, requires_grad=True)
    w = torch.ones(128, device=dev, dtype=dtype, requires_grad=True)
    q = torch.randn(1, 4, 2, 128, device=dev, dtype=dtype, requires_grad=True)
    cos, sin = torch.ones(1, 4, 128, device=dev, dtype=dtype), torch.zeros(1, 4, 128, device=dev, dtype=dtype)
    impls = _implementations(settings)

    def peer(name: str) -> Callable[[], torch.Tensor]:
        norm = impls[name]()
        return lambda: norm(x, w)

    rows: list[tuple[str, Callable[[], Callable[[], torch.Tensor]]]] = [
        ("rms_norm eager PyTorch", lambda: lambda: eager_rms_norm(x, w, EPS)),
        ("rms_norm torch.compile", lambda: peer("torch.compile")),
        ("rms_norm liger", lambda: peer("liger")),
        ("rms_norm d9d (public op)", lambda: lambda: rms_norm(x, w, EPS)),
        ("rms_norm d9d eager path", lambda: lambda: rms_norm_op.rms_norm_triton(x, w, EPS, False)),
        ("rms_norm d9d custom op", lambda: lambda: ops.rms_norm_forward(x, w, EPS, False)[0]),
        ("swiglu d9d eager path", lambda: lambda: swiglu_op.swiglu_triton(x, x)),
        ("swiglu d9d custom op", lambda: lambda: ops.swiglu_forward(x, x)),
        ("rope d9d eager path", lambda: lambda: rope_op.apply_rope_triton(q, cos, sin, False)),
        ("rope d9d custom op", lambda: lambda: ops.apply_rope(q, cos, sin, False, False)),
    ]
    results = [_host_row(name, forward, dev) for name, forward in rows]
    header = {
        "input": "x (4, 128), q (1, 4, 2, 128) bf16",
        "columns": "host microseconds per call in a loop (wall ms: forward + backward per call)",
    }
    report("rms_norm_host_overhead", results, settings, header)
    return results


def _sweep() -> None:
    """GPU kernel ms of d9d's forward and backward for several tile rows and programs per SM."""
    from d9d.kernels._triton.launch import next_power_of_2
    from d9d.kernels._triton.rms_norm_kernels import rms_norm_forward, tile_rows

    print("\n### rms_norm tile sweep (d9d kernels alone, GPU ms)")
    columns = " | ".join(f"bwd, {p} programs/SM" for p in SWEEP_PROGRAMS_PER_SM)
    print(f"| shape | rows per tile | fwd | {columns} |\n" + "|---" * (3 + len(SWEEP_PROGRAMS_PER_SM)) + "|")
    for label, rows, hidden in SHAPES[:2]:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w, dy = torch.rand(hidden, device="cuda", dtype=torch.bfloat16), torch.randn_like(x)
        _, rstd = rms_norm_forward(x, w, EPS, False)
        default = tile_rows(next_power_of_2(hidden))
        for tile in sorted({1, 4, 8, 16, 32, 64, default}):
            if tile * next_power_of_2(hidden) <= 16384:
                cells = _sweep_cells(x, w, dy, rstd, tile)
                mark = " (default)" if tile == default else ""
                print(f"| {label} | {tile}{mark} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")


def _sweep_cells(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, rstd: torch.Tensor, tile: int
) -> list[float]:
    from d9d.kernels._triton.rms_norm_kernels import rms_norm_backward, rms_norm_forward

    cells = [gpu_kernel_ms(lambda: rms_norm_forward(x, w, EPS, False, rows_per_tile=tile))]
    for per_sm in SWEEP_PROGRAMS_PER_SM:
        cells.append(
            gpu_kernel_ms(
                lambda per_sm=per_sm: rms_norm_backward(
                    dy, x, w, rstd, False, rows_per_tile=tile, programs_per_sm=per_sm
                )
            )
        )
    return cells


def run(settings: Settings) -> list[Result]:
    copy = copy_bandwidth_gbs(settings.device)
    results: list[Result] = []
    for label, rows, hidden in SMOKE_SHAPES if settings.smoke else SHAPES:
        results += _bench_shape(settings, label, rows, hidden, copy)
    results += _host_overhead(settings)
    if "--sweep" in sys.argv and settings.device == "cuda":
        _sweep()
    return results


if __name__ == "__main__":
    run(parse_settings(__doc__ or ""))
