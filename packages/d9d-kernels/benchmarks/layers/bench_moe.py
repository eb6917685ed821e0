"""MoE layer forward + backward tokens/s against a naive per-expert loop, same weights, one GPU, bf16.

Run from the repository root on a CUDA machine:
    PYTHONPATH=packages/d9d-kernels/src python3 packages/d9d-kernels/benchmarks/layers/bench_moe.py

The naive loop is what Hugging Face's eager experts do: for every expert, gather its tokens, run
its SwiGLU, scale by the routing weight and scatter-add back.
"""

import argparse
import json
from collections.abc import Callable

import torch
from torch.nn import functional

from d9d.kernels.layers import MoELayer

# (name, hidden, experts, top_k, expert intermediate, tokens)
CONFIGS = [
    ("qwen3-30b-a3b-like", 2048, 128, 8, 768, 16384),
    ("64 experts top-4", 2048, 64, 4, 768, 32768),
]


def time_ms(step: Callable[[], object], *, warmup: int = 3, iters: int = 10) -> float:
    """Mean milliseconds of ``step`` (CUDA events) after ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def naive_moe(layer: MoELayer, hidden: torch.Tensor) -> torch.Tensor:
    routing = layer.router(hidden)
    weights = routing.routing_weights.to(hidden.dtype)
    out = torch.zeros_like(hidden)
    experts = layer.experts
    for expert in range(layer.num_experts):
        token_index, slot = torch.where(routing.expert_indices == expert)
        if token_index.numel() == 0:
            continue
        x = hidden[token_index]
        h = functional.silu(x @ experts.gate_proj[expert]) * (x @ experts.up_proj[expert])
        y = (h @ experts.down_proj[expert]) * weights[token_index, slot, None]
        out = out.index_add(0, token_index, y)
    return out


def bench_config(
    name: str, hidden_size: int, experts: int, top_k: int, intermediate: int, tokens: int
) -> list[dict[str, object]]:
    """Times both implementations on one configuration and prints their table rows."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    layer = MoELayer(hidden_size, experts, top_k, intermediate).to(device=device, dtype=torch.bfloat16)
    hidden = torch.randn(tokens, hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    upstream = torch.randn(tokens, hidden_size, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        difference = float((layer(hidden) - naive_moe(layer, hidden)).abs().max())
    timings = {
        "d9d MoELayer": time_ms(lambda: layer(hidden).backward(upstream), warmup=2, iters=5),
        "naive loop": time_ms(lambda: naive_moe(layer, hidden).backward(upstream), warmup=2, iters=5),
    }
    shape = f"H={hidden_size}, E={experts}, k={top_k}, I={intermediate}, T={tokens}"
    rows: list[dict[str, object]] = []
    for implementation, ms in timings.items():
        speed_up = timings["naive loop"] / ms
        throughput = tokens / ms * 1e3
        print(
            f"| {name} ({shape}) | {implementation} | {ms:.2f} | {throughput:,.0f} | {speed_up:.2f}x | "
            f"{difference:.3g} |"
        )
        rows.append({"config": name, "implementation": implementation, "ms": ms, "tokens_per_s": throughput})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| config | implementation | fwd+bwd ms | tokens/s | speed-up | max abs diff vs naive |")
    print("|---|---|---|---|---|---|")
    results: list[dict[str, object]] = []
    for config in CONFIGS:
        results.extend(bench_config(*config))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
