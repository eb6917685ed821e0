"""Grouped LoRA under d9d-parallel's expert parallelism on 2 CPU ranks equals one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from d9d.loop.peft import GroupedLoRAExperts, LoRAConfig, inject_lora, merged_state
from d9d.mesh.testing import run_distributed
from d9d.parallel import parallelize_expert_parallel

HIDDEN, FFN, EXPERTS, TOP_K = 6, 5, 4, 2


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) * 0.5)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        groups = tokens.split(tokens_per_expert.tolist())
        outs = [torch.tanh(g @ self.w_in[e]) @ self.w_out[e] for e, g in enumerate(groups)]
        return torch.cat(outs)


class _LocalDispatcher:
    """Single-process dispatch: rows sorted by expert, combined with the routing weights."""

    def __init__(self) -> None:
        self.order = torch.empty(0, dtype=torch.long)
        self.weights = torch.empty(0)

    def dispatch(
        self, hidden: torch.Tensor, expert_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat = expert_indices.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.weights = routing_weights
        return hidden[self.order // expert_indices.shape[1]], torch.bincount(flat, minlength=EXPERTS)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        rows = expert_output[torch.argsort(self.order)]
        return (rows.view(*self.weights.shape, -1) * self.weights.unsqueeze(-1)).sum(1)


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = EXPERTS, TOP_K
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.shared_expert = nn.Linear(HIDDEN, HIDDEN)
        self.experts = _Experts()
        self.dispatcher: Any = _LocalDispatcher()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        tokens, counts = self.dispatcher.dispatch(x, indices, weights)
        return self.dispatcher.combine(self.experts(tokens, counts)) + self.shared_expert(x)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(expert_parallel: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Moe()
    inject_lora(model, LoRAConfig(target="experts", r=2, alpha=4.0))
    assert isinstance(model.experts, GroupedLoRAExperts)
    with torch.no_grad():  # B away from zero, so A has gradients from the first step
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.normal_(0, 0.5)
    rank, world = 0, 1
    if expert_parallel:
        rank, world = dist.get_rank(), dist.get_world_size()
        parallelize_expert_parallel(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
        for name, parameter in model.experts.named_parameters():
            assert isinstance(parameter, DTensor) and parameter.placements == (Shard(0),), name
            assert parameter.to_local().shape[0] == EXPERTS // world, name
    generator = torch.Generator().manual_seed(1)
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    for _ in range(2):
        x, y = torch.randn(16, HIDDEN, generator=generator), torch.randn(16, HIDDEN, generator=generator)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        total = loss.detach().clone()
        if expert_parallel:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
        grads.append({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.sub_(0.5 * parameter.grad)
    merged = {n: _full(t) for n, t in merged_state(model).items() if n.startswith("experts.")}
    return {"losses": losses, "grads": grads, "merged": merged}


def test_grouped_lora_under_expert_parallelism_matches_one_process() -> None:
    single = _train(False)
    for result in run_distributed(_train, True, world_size=2):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single["losses"]))
        for got, expected in zip(result["grads"], single["grads"], strict=True):
            assert set(got) == {f"experts.lora_{w}.lora_{m}" for w in ("w_in", "w_out") for m in "AB"}
            for name, value in expected.items():
                torch.testing.assert_close(got[name], value, msg=name)
        # the merged export (W + scale * A @ B per expert) gathers to the single process's
        assert set(result["merged"]) == {"experts.w_in", "experts.w_out"}
        for name, value in single["merged"].items():
            torch.testing.assert_close(result["merged"][name], value, msg=name)
