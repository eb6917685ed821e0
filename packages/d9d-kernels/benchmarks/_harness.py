"""Shared benchmark harness: timing, peak memory, copy bandwidth, tables and plots.

Every op script builds a list of named implementations, each a zero-argument callable that runs
one forward + backward (or one step), and hands it to ``run_op``. ``--smoke`` runs the same code on
CPU at tiny shapes (no timings worth reading) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

GIB = 2**30


@dataclass(kw_only=True)
class Result:
    """One implementation's measurement."""

    name: str
    ms: float | None
    peak_gib: float | None
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Settings:
    """Command-line settings shared by the scripts."""

    smoke: bool
    out: Path
    device: str


def parse_settings(description: str) -> Settings:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script only")
    parser.add_argument("--out", type=Path, default=Path("benchmark-results"), help="folder for JSON and PNG")
    args, _ = parser.parse_known_args()
    return settings_for(smoke=args.smoke, out=args.out)


def settings_for(*, smoke: bool, out: Path) -> Settings:
    out.mkdir(parents=True, exist_ok=True)
    return Settings(smoke=smoke, out=out, device="cpu" if smoke else "cuda")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def gpu_us(fn: Callable[[], object]) -> float:
    """Microseconds per call of ``fn`` by ``triton.testing.do_bench``, after one call to compile."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=60) * 1000


def outputs_close(got: tuple[torch.Tensor | None, ...], expected: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether each output is within 1% of the largest magnitude of its expected value (None skips)."""

    def near(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (a.float() - b.float()).abs().max().item() <= 1e-2 * max(1.0, b.float().abs().max().item())

    return all(a is None or b is None or near(a, b) for a, b in zip(got, expected, strict=True))


def gpu_kernel_ms(
    fn: Callable[[], object],
    iters: int = 5,
    *,
    before: Callable[[], object] | None = None,
    kernels: str | None = None,
) -> float:
    """Milliseconds of GPU work (kernels, copies, memsets) per call of ``fn``, from the profiler.

    Unlike wall time between CUDA events, this excludes the host's launch and autograd overhead,
    which dominates small memory-bound ops when they run alone. ``before`` runs ahead of every call
    (e.g. a write that flushes the L2 cache); ``kernels`` counts only the GPU work whose name
    contains it (then ``before``'s work is left out).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    total_us = sum(
        e.time_range.elapsed_us()
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and (kernels is None or kernels in e.name)
    )
    return total_us / 1e3 / iters


def measure(
    fn: Callable[[], object], device: str, *, warmup: int = 3, iters: int = 10
) -> tuple[float, float]:
    """Median milliseconds of ``fn`` and its peak memory above what was allocated before it (GiB)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    peak = 0.0
    if device == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / GIB
    times: list[float] = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), peak


def copy_bandwidth_gbs(device: str, gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    n = int(gib * GIB) // 2 if device == "cuda" else 1 << 20
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms, _ = measure(lambda: dst.copy_(src), device, warmup=3, iters=20)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def dense_matmul_tflops(device: str, m: int = 8192, n: int = 8192, k: int = 8192) -> float:
    """bf16 dense matmul rate on random data, TFLOP/s."""
    if device != "cuda":
        m = n = k = 64
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    ms, _ = measure(lambda: a @ b, device, warmup=3, iters=10)
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def attempt(name: str, fn_factory: Callable[[], Callable[[], object]], device: str, **kw: int) -> Result:
    """Measures ``fn_factory()``; an implementation that cannot run here is recorded with the reason."""
    try:
        fn = fn_factory()
        ms, peak = measure(fn, device, **kw)
        result = Result(name=name, ms=ms, peak_gib=peak)
        if device == "cuda":
            try:
                result.extra["GPU ms"] = gpu_kernel_ms(fn)
            except Exception as error:
                result.note = f"no GPU time: {type(error).__name__}: {error}"[:160]
        return result
    except Exception as error:  # a missing peer must not stop the others
        message = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        return Result(name=name, ms=None, peak_gib=None, note=message)
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def report(op: str, results: list[Result], settings: Settings, header: dict[str, object]) -> None:
    """Prints a Markdown table, and writes ``<op>.json`` and ``<op>.png`` into the output folder."""
    print(f"\n### {op}")
    for key, value in header.items():
        print(f"- {key}: {value}")
    extra_keys = sorted({k for r in results for k in r.extra})
    print(
        "| impl | wall ms | peak GiB | " + " | ".join(extra_keys) + (" |" if extra_keys else "") + " note |"
    )
    print("|---" * (4 + len(extra_keys)) + "|")
    for r in results:
        cells = [
            r.name,
            f"{r.ms:.3f}" if r.ms is not None else "n/a",
            f"{r.peak_gib:.3f}" if r.peak_gib is not None else "n/a",
        ]
        cells += [f"{r.extra[k]:.3g}" if k in r.extra else "" for k in extra_keys]
        print("| " + " | ".join(cells) + f" | {r.note} |")
    (settings.out / f"{op}.json").write_text(
        json.dumps(
            {"op": op, "header": header, "results": [asdict(r) for r in results]}, indent=1, default=str
        )
    )
    _plot(op, results, settings.out / f"{op}.png")


def _plot(op: str, results: list[Result], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in results if r.ms is not None]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [r.name for r in ok]
    axes[0].barh(names, [r.ms or 0.0 for r in ok], color="tab:blue")
    axes[0].set_xlabel("wall ms (forward + backward), lower is better")
    axes[1].barh(names, [r.peak_gib or 0.0 for r in ok], color="tab:orange")
    axes[1].set_xlabel("peak memory above inputs (GiB)")
    for ax in axes:
        ax.invert_yaxis()
    fig.suptitle(op)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def liger_functional() -> object:
    """``liger_kernel.transformers.functional``; raises ImportError where Liger-Kernel is absent."""
    from liger_kernel.transformers import functional

    return functional
