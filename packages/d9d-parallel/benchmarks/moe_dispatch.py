"""DeepEP against the all-to-all dispatcher at Qwen3-30B-A3B widths, on the GPUs of one host.

Run:  torchrun --nproc-per-node 2 packages/d9d-parallel/benchmarks/moe_dispatch.py [--tokens 4096 8192]

Qwen3-30B-A3B's MoE: hidden 2048, 128 experts, top-8, expert width 768, bfloat16. Each rank
routes its own tokens (random router weights, so the load is near uniform) and the experts
are split over the ranks (64 each on 2 GPUs). For each dispatcher, the median over
``--iters`` of three timings (CUDA events, after ``--warmup`` runs):

- ``dispatch+combine fwd``: dispatch, then combine of the grouped rows as they came (no experts);
- ``dispatch+combine fwd+bwd``: the same with a backward through both;
- ``MoE layer step``: router, dispatch, SwiGLU experts (a loop of matmuls per local expert),
  combine, and the backward of all of it.

Rank 0 prints milliseconds and the DeepEP / all-to-all ratio (below 1: DeepEP is faster).
Without DeepEP (scripts/build-deepep.sh builds it) only the all-to-all figures are printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.parallel import DeepEPBuffers, TokenDispatcherKind, parallelize_expert_parallel


class SwiGLUExperts(nn.Module):
    def __init__(self, experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(experts, hidden, 2 * width) * hidden**-0.5)
        self.down = nn.Parameter(torch.randn(experts, width, hidden) * width**-0.5)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, group in enumerate(tokens.split(tokens_per_expert.tolist())):
            gate, up = (group @ self.gate_up[e]).chunk(2, dim=-1)
            outs.append((nn.functional.silu(gate) * up) @ self.down[e])
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, *, hidden: int, experts: int, top_k: int, width: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.shared_expert = None
        self.experts = SwiGLUExperts(experts, hidden, width)
        self.dispatcher = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, indices = torch.softmax(self.router(x).float(), dim=-1).topk(self.top_k, dim=-1)
        return indices, weights / weights.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        indices, weights = self.route(x)
        tokens, counts = self.dispatcher.dispatch(x, indices, weights)
        return self.dispatcher.combine(self.experts(tokens, counts))


def _median_ms(step: Callable[[], None], *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    # A dispatcher is as slow as its slowest rank.
    worst = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _measure(kind: TokenDispatcherKind, model: MoE, x: torch.Tensor, args: argparse.Namespace) -> list[float]:
    mesh = DeviceMesh("cuda", torch.arange(dist.get_world_size()), mesh_dim_names=("ep",))
    buffers = DeepEPBuffers() if kind == "deep_ep" else None
    parallelize_expert_parallel(model, mesh=mesh, dispatcher=kind, deep_ep_buffers=buffers)
    dispatcher = model.dispatcher
    assert dispatcher is not None
    indices, weights = model.route(x)
    grad = torch.randn_like(x)

    def exchange(backward: bool) -> None:
        with torch.set_grad_enabled(backward):
            leaf = x.detach().requires_grad_(backward)
            tokens, _ = dispatcher.dispatch(leaf, indices, weights.detach().requires_grad_(backward))
            out = dispatcher.combine(tokens)
        if backward:
            out.backward(grad)

    def layer_step() -> None:
        model(x.detach().requires_grad_(True)).backward(grad)

    warmup, iters = args.warmup, args.iters
    return [
        _median_ms(lambda: exchange(False), warmup=warmup, iters=iters),
        _median_ms(lambda: exchange(True), warmup=warmup, iters=iters),
        _median_ms(layer_step, warmup=warmup, iters=iters),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192], help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=768)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    index = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=300))
    rank0 = dist.get_rank() == 0
    kinds: list[TokenDispatcherKind] = ["all_to_all"]
    if importlib.util.find_spec("deep_ep") is not None:
        kinds.append("deep_ep")
    elif rank0:
        print("deep_ep is not importable (scripts/build-deepep.sh builds it): all-to-all figures only")
    names = ["dispatch+combine fwd", "dispatch+combine fwd+bwd", "MoE layer step"]
    try:
        for tokens in args.tokens:
            figures: dict[str, list[float]] = {}
            for kind in kinds:
                torch.manual_seed(0)
                model = MoE(
                    hidden=args.hidden, experts=args.experts, top_k=args.top_k, width=args.expert_width
                ).to(device=device, dtype=torch.bfloat16)
                x = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16)
                figures[kind] = _measure(kind, model, x, args)
                del model
                torch.cuda.empty_cache()
            if rank0:
                print(
                    f"\nep={dist.get_world_size()} tokens/rank={tokens} hidden={args.hidden} "
                    f"experts={args.experts} top-{args.top_k} width={args.expert_width} bf16"
                )
                print(f"{'':28}{'all_to_all ms':>15}{'deep_ep ms':>12}{'ratio':>8}")
                for i, name in enumerate(names):
                    base = figures["all_to_all"][i]
                    deep = figures.get("deep_ep", [float("nan")] * 3)[i]
                    print(f"{name:28}{base:15.3f}{deep:12.3f}{deep / base:8.2f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
