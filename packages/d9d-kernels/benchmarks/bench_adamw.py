"""Stochastic-rounding AdamW step on bf16 parameters: bandwidth against the copy bandwidth.

Implementations: torch.optim.AdamW (foreach, and fused) on the same bf16 tensors (round-to-nearest,
for reference), torch.compile of the stochastic-rounding reference step, and d9d's fused kernel with
fp32 and bf16 moments. Liger-Kernel has no optimizer.

The second table steps a whole model's parameter list (Qwen3-0.6B's 310 tensors, 0.6 B parameters,
bf16 with bf16 moments): d9d's multi-tensor kernel (one launch), d9d's kernel called once per
tensor, and torch's fused AdamW over the list; there the wall time shows the host's share.

Run: python packages/d9d-kernels/benchmarks/bench_adamw.py --out DIR   (--smoke on CPU)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from _harness import Result, Settings, attempt, copy_bandwidth_gbs, parse_settings, report

from d9d.kernels import KernelBackend, StochasticAdamW, adamw_step_stochastic_


def _round_stochastic(x: torch.Tensor) -> torch.Tensor:
    noise = torch.randint_like(x, 0, 1 << 16, dtype=torch.int32)
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def eager_sr_adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    """The same math as d9d's kernel in plain PyTorch (fp32 moments), for torch.compile to fuse."""
    lr, beta1, beta2, eps, wd, step = 1e-4, 0.9, 0.999, 1e-8, 0.1, 10
    gf = g.float()
    m.mul_(beta1).add_(gf, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(gf, gf, value=1 - beta2)
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    update = p.float() * (1 - lr * wd) - lr / (1 - beta1**step) * m / denom
    p.copy_(_round_stochastic(update))


def run(settings: Settings) -> list[Result]:
    n = 1 << 12 if settings.smoke else 1 << 29  # 537M parameters
    dev = settings.device
    backend = KernelBackend.REFERENCE if settings.smoke else KernelBackend.AUTO
    param = torch.randn(n, device=dev).to(torch.bfloat16)
    grad = torch.randn(n, device=dev).to(torch.bfloat16)
    results: list[Result] = []
    bytes_per_element: dict[str, int] = {}

    def d9d_step(state_dtype: torch.dtype) -> Callable[[], object]:
        m = torch.zeros(n, device=dev, dtype=state_dtype)
        v = torch.zeros(n, device=dev, dtype=state_dtype)
        return lambda: adamw_step_stochastic_(
            param, grad, m, v, lr=1e-4, weight_decay=0.1, step=10, seed=1, backend=backend
        )

    def torch_adamw(fused: bool) -> Callable[[], object]:
        p = torch.nn.Parameter(param.clone())
        p.grad = grad.clone()
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=fused, foreach=not fused)
        return opt.step

    compiled_reference = torch.compile(eager_sr_adamw)

    def compiled_step() -> Callable[[], object]:
        m = torch.zeros(n, device=dev)
        v = torch.zeros(n, device=dev)
        return lambda: compiled_reference(param, grad, m, v)

    cases: list[tuple[str, Callable[[], Callable[[], object]], int]] = [
        ("torch AdamW foreach (bf16 state, RTN)", lambda: torch_adamw(False), 2 + 2 + 2 * 2 + 2 + 2 * 2),
        ("torch AdamW fused (bf16 state, RTN)", lambda: torch_adamw(True), 2 + 2 + 2 * 2 + 2 + 2 * 2),
        ("torch.compile SR AdamW (fp32 state)", compiled_step, 2 + 2 + 2 * 4 + 2 + 2 * 4),
        ("d9d fused SR (fp32 state)", lambda: d9d_step(torch.float32), 2 + 2 + 2 * 4 + 2 + 2 * 4),
        ("d9d fused SR (bf16 state)", lambda: d9d_step(torch.bfloat16), 2 + 2 + 2 * 2 + 2 + 2 * 2),
    ]
    if settings.smoke:
        cases = [c for c in cases if "fused (bf16" not in c[0]]
    copy = copy_bandwidth_gbs(dev)
    for name, factory, bpe in cases:
        r = attempt(name, factory, dev)
        bytes_per_element[name] = bpe
        if r.ms is not None:
            r.extra["GB/s"] = bpe * n / (r.extra.get("GPU ms", r.ms) * 1e-3) / 1e9
            r.extra["% copy BW"] = 100 * r.extra["GB/s"] / copy
        results.append(r)
    header = {"parameters": n, "copy bandwidth GB/s": round(copy, 1), "bytes per element": bytes_per_element}
    report("adamw_stochastic", results, settings, header)
    return results + run_model_list(settings, copy)


def qwen3_shapes(smoke: bool) -> list[tuple[int, ...]]:
    """Parameter shapes of Qwen3-0.6B (tied embedding), or a 2-layer miniature for ``--smoke``."""
    hidden, heads, kv_heads, head_dim, ffn, layers, vocab = (
        (64, 2, 1, 32, 96, 2, 128) if smoke else (1024, 16, 8, 128, 3072, 28, 151936)
    )
    layer = [
        (heads * head_dim, hidden),
        (kv_heads * head_dim, hidden),
        (kv_heads * head_dim, hidden),
        (hidden, heads * head_dim),
        (head_dim,),
        (head_dim,),
        (hidden,),
        (hidden,),
        (ffn, hidden),
        (ffn, hidden),
        (hidden, ffn),
    ]
    return [(vocab, hidden), *(layer * layers), (hidden,)]


def run_model_list(settings: Settings, copy: float) -> list[Result]:
    """One optimizer step over a model's parameter list: launches and host time included."""
    dev = settings.device
    shapes = qwen3_shapes(settings.smoke)
    backend = KernelBackend.REFERENCE if settings.smoke else KernelBackend.AUTO

    def parameters() -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(torch.randn(shape, device=dev).to(torch.bfloat16)) for shape in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        return params

    def d9d_multi() -> Callable[[], object]:
        return StochasticAdamW(parameters(), lr=1e-4, weight_decay=0.1, backend=backend).step

    def d9d_per_tensor() -> Callable[[], object]:
        params = parameters()
        moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

        @torch.no_grad()
        def step() -> None:
            for p, (m, v) in zip(params, moments, strict=True):
                assert p.grad is not None
                adamw_step_stochastic_(p, p.grad, m, v, lr=1e-4, weight_decay=0.1, step=10, backend=backend)

        return step

    def torch_fused() -> Callable[[], object]:
        return torch.optim.AdamW(parameters(), lr=1e-4, weight_decay=0.1, fused=dev == "cuda").step

    cases: list[tuple[str, Callable[[], Callable[[], object]]]] = [
        ("model list: d9d multi-tensor SR (bf16 state)", d9d_multi),
        ("model list: d9d SR, one call per tensor (bf16 state)", d9d_per_tensor),
        ("model list: torch AdamW fused (bf16 state, RTN)", torch_fused),
    ]
    elements = sum(torch.Size(shape).numel() for shape in shapes)
    results: list[Result] = []
    for name, factory in cases:
        r = attempt(name, factory, dev)
        if r.ms is not None:
            r.extra["GB/s"] = 14 * elements / (r.extra.get("GPU ms", r.ms) * 1e-3) / 1e9
            r.extra["% copy BW"] = 100 * r.extra["GB/s"] / copy
        results.append(r)
        torch.cuda.empty_cache() if dev == "cuda" else None
    header = {"tensors": len(shapes), "parameters": elements, "copy bandwidth GB/s": round(copy, 1)}
    report("adamw_stochastic_model_list", results, settings, header)
    return results


if __name__ == "__main__":
    run(parse_settings(__doc__ or ""))
