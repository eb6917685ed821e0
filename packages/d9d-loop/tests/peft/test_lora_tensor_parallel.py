"""LoRA under torch's ColwiseParallel / RowwiseParallel on 2 CPU ranks equals one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from d9d.loop.peft import LoRAConfig, LoRALinear, inject_lora, place_adapters_like_base
from d9d.mesh.testing import run_distributed


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _model() -> _Mlp:
    torch.manual_seed(0)
    model = _Mlp()
    inject_lora(model, LoRAConfig(target="up|down", r=2, alpha=4.0))
    with torch.no_grad():  # B away from zero, so A has gradients from the first step
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.normal_(0, 0.5)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(tensor_parallel: bool) -> dict[str, Any]:
    model = _model()
    placements: dict[str, str] = {}
    if tensor_parallel:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        assert place_adapters_like_base(model) == ["up", "down"]
        for name, parameter in model.named_parameters():
            if isinstance(parameter, DTensor):
                placements[name] = str(parameter.placements)
        # on the meta device (as d9d builds stages) the layout is the same
        with torch.device("meta"):
            meta = _Mlp()
        inject_lora(meta, LoRAConfig(target="up|down", r=2, alpha=4.0))
        parallelize_module(meta, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        place_adapters_like_base(meta)
        assert {
            n: str(p.placements) for n, p in meta.named_parameters() if isinstance(p, DTensor)
        } == placements
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(1)
    losses, grads = [], []
    for _ in range(2):
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    return {"losses": losses, "grads": grads, "placements": placements}


def test_lora_with_column_and_row_parallel_bases_matches_one_process() -> None:
    single = _train(False)
    for result in run_distributed(_train, True, world_size=2):
        assert result["placements"] == {
            "up.weight": str((Shard(0),)),
            "up.bias": str((Shard(0),)),
            "up.lora_A": str((Replicate(),)),
            "up.lora_B": str((Shard(0),)),
            "down.weight": str((Shard(1),)),
            "down.bias": str((Replicate(),)),
            "down.lora_A": str((Shard(1),)),
            "down.lora_B": str((Replicate(),)),
        }
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single["losses"]))
        for got, expected in zip(result["grads"], single["grads"], strict=True):
            assert set(got) == {"up.lora_A", "up.lora_B", "down.lora_A", "down.lora_B"}
            for name, value in expected.items():
                torch.testing.assert_close(got[name], value, msg=name)
