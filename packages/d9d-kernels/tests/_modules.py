"""Modules and helpers the tests share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def compile_capturing_graph(
    step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, str]:
    """``step(x)`` compiled in one graph without gradients, and that graph's text (the FX graph Dynamo
    hands its backend, before Inductor)."""
    graphs: list[str] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        graphs.append(str(graph.graph))
        return graph

    with torch.no_grad():
        return torch.compile(step, fullgraph=True, backend=backend)(x), graphs[0]


class ScaledLinear(nn.Module):
    """A replacement of an ``nn.Linear`` (as LoRA's or FP8's are): a mode must call it, not group it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.linear(x)
