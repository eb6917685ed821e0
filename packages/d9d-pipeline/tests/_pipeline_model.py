"""A tiny multi-layer model split into pipeline stages whose inputs and outputs are several tensors."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from d9d.pipeline import PipelineStageInfo, layers_of_stage

HIDDEN = 8
IN_FEATURES = 6
OUT_FEATURES = 3


class Stage(nn.Module):
    """Stage inputs/outputs: {"h": float, "aux": float, "ids": int64}; the last stage returns {"y", "ids"}."""

    def __init__(self, info: PipelineStageInfo, num_layers: int) -> None:
        super().__init__()
        self.info = info
        self.embed = nn.Linear(IN_FEATURES, HIDDEN) if info.is_first else None
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in layers_of_stage(info, num_layers))
        self.head = nn.Linear(HIDDEN, OUT_FEATURES) if info.is_last else None
        self._point: Callable[[torch.Tensor], None] | None = None

    def set_overlap_point(self, point: Callable[[torch.Tensor], None] | None) -> None:
        """d9d.pipeline.OverlapPoints: the forward calls ``point`` after each layer."""
        self._point = point

    def forward(
        self, inputs: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if self.embed is not None:
            h = self.embed(inputs["x"])
            aux = inputs["x"][:, :1].clone()
            ids = inputs["ids"]
        else:
            h, aux, ids = inputs["h"], inputs["aux"], inputs["ids"]
        for layer in self.layers:
            h = h + torch.tanh(layer(h)) * shared["scale"]
            aux = aux + h.mean(dim=-1, keepdim=True) * (ids.unsqueeze(-1) % 3).to(h.dtype)
            if self._point is not None:
                self._point(h)
        if self.head is not None:
            return {"y": self.head(h) + aux, "ids": ids}
        return {"h": h, "aux": aux, "ids": ids}


def build_stages(num_stages: int, num_layers: int, seed: int = 0) -> list[Stage]:
    torch.manual_seed(seed)
    return [Stage(PipelineStageInfo(s, num_stages), num_layers) for s in range(num_stages)]


def make_batch(
    batch: int, seed: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    inputs = {
        "x": torch.randn(batch, IN_FEATURES, generator=gen),
        "ids": torch.randint(0, 10, (batch,), generator=gen),
    }
    shared = {"scale": torch.tensor(0.7)}
    target = torch.randn(batch, OUT_FEATURES, generator=gen)
    return inputs, shared, target


def make_loss_fn(target: torch.Tensor, num_microbatches: int) -> Any:
    targets = target.chunk(num_microbatches)
    weights = [1.0 + 0.5 * m for m in range(num_microbatches)]

    def loss_fn(outputs: dict[str, torch.Tensor], microbatch: int) -> torch.Tensor:
        return ((outputs["y"] - targets[microbatch]) ** 2).mean() * weights[microbatch]

    return loss_fn


def reference(
    stages: list[Stage],
    inputs: dict[str, torch.Tensor],
    shared: dict[str, torch.Tensor],
    target: torch.Tensor,
    num_microbatches: int,
) -> tuple[list[torch.Tensor], list[Stage], list[dict[str, torch.Tensor]]]:
    """Runs a copy of all stages on each microbatch without a pipeline.

    Returns the losses, the copies (holding the gradients) and the outputs.
    """
    model = copy.deepcopy(stages)
    loss_fn = make_loss_fn(target, num_microbatches)
    losses: list[torch.Tensor] = []
    outputs: list[dict[str, torch.Tensor]] = []
    x_mbs = inputs["x"].chunk(num_microbatches)
    id_mbs = inputs["ids"].chunk(num_microbatches)
    for m in range(num_microbatches):
        tree: Any = {"x": x_mbs[m], "ids": id_mbs[m]}
        for stage in model:
            tree = stage(tree, shared)
        outputs.append({k: v.detach() for k, v in tree.items()})
        loss = loss_fn(tree, m)
        loss.backward()
        losses.append(loss.detach())
    return losses, model, outputs
