"""Tensor parallelism of grouped (per-expert) SwiGLU projections against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from d9d.mesh.testing import run_distributed
from d9d.parallel import clip_grad_norm, parallelize_grouped_tensor_parallel

GROUPS, HIDDEN, INNER = 3, 8, 12


class GroupedSwiGLU(nn.Module):
    """The experts contract: ``forward(tokens (M, H), tokens_per_group (G,))``; inner size from weights."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(GROUPS, HIDDEN, INNER) / HIDDEN**0.5)
        self.up_proj = nn.Parameter(torch.randn(GROUPS, HIDDEN, INNER) / HIDDEN**0.5)
        self.down_proj = nn.Parameter(torch.randn(GROUPS, INNER, HIDDEN) / INNER**0.5)

    def forward(self, tokens: torch.Tensor, tokens_per_group: torch.Tensor) -> torch.Tensor:
        outputs = []
        for g, chunk in enumerate(tokens.split(tokens_per_group.tolist())):
            inner = F.silu(chunk @ self.gate_proj[g]) * (chunk @ self.up_proj[g])
            outputs.append(inner @ self.down_proj[g])
        return torch.cat(outputs)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    counts = torch.tensor([3, 0, 5])  # uneven, one empty group
    return torch.randn(int(counts.sum()), HIDDEN, generator=generator), counts


def _train(tp: bool) -> dict[str, object]:
    torch.manual_seed(0)
    model = GroupedSwiGLU()
    if tp:
        mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()), mesh_dim_names=("tp",))
        parallelize_grouped_tensor_parallel(model, mesh=mesh)
        assert isinstance(model.gate_proj, DTensor) and model.gate_proj.placements == (Shard(2),)
        assert isinstance(model.down_proj, DTensor) and model.down_proj.placements == (Shard(1),)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, norms, input_grads = [], [], []
    for step in range(3):
        tokens, counts = _batch(step)
        tokens.requires_grad_(True)
        out = model(tokens, counts)
        loss = (out * torch.linspace(-1, 1, HIDDEN)).square().mean()
        loss.backward()
        norms.append(float(clip_grad_norm(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        input_grads.append(tokens.grad)
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return {"losses": losses, "norms": norms, "input_grads": input_grads, "params": params}


@pytest.mark.parametrize("world", [2, 4])  # inner size 12 over 2 and over 4 tp ranks
def test_grouped_tensor_parallel_matches_single_process(world: int) -> None:
    reference = run_distributed(_train, False, world_size=1)[0]
    for result in run_distributed(_train, True, world_size=world, timeout_s=180):
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(result["norms"], reference["norms"], rtol=1e-5, atol=1e-7)
        for got, want in zip(result["input_grads"], reference["input_grads"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)


def _indivisible() -> None:
    mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()), mesh_dim_names=("tp",))
    with pytest.raises(
        ValueError, match=r"GroupedSwiGLU.gate_proj has size 12 along tensor dim 2, not divisible by the 5"
    ):
        parallelize_grouped_tensor_parallel(GroupedSwiGLU(), mesh=mesh)
    with pytest.raises(ValueError, match="has no parameter 'w1'"):
        parallelize_grouped_tensor_parallel(GroupedSwiGLU(), mesh=mesh, column_parameters=("w1",))


def test_bad_input_names_module_and_parameter() -> None:
    run_distributed(_indivisible, world_size=5)
