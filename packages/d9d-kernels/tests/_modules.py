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


PAGE = 4
"""Slots per block of ``paged_decode_step``'s pool."""
BLOCKS = 5
"""Block-table columns per row of ``paged_decode_step``'s pool."""


def paged_decode_step(
    lengths: list[int], *, kv_heads: int = 2, head_dim: int = 16, value_dim: int = 16
) -> dict[str, torch.Tensor]:
    """A decode step over a paged pool: shuffled blocks holding stale values, each row's query and new
    token (at ``length - 1``; an idle row, length 0, writes into a spare block no row reads), float32,
    two query heads per key/value head."""
    gen = torch.Generator().manual_seed(len(lengths) * 100 + head_dim)
    rows = len(lengths)
    num_blocks = rows * BLOCKS + 2
    order = torch.randperm(num_blocks, generator=gen)
    table = order[: rows * BLOCKS].view(rows, BLOCKS)
    spare = int(order[-1]) * PAGE
    slots = [
        int(table[row, (length - 1) // PAGE]) * PAGE + (length - 1) % PAGE if length > 0 else spare
        for row, length in enumerate(lengths)
    ]
    return {
        "query": torch.randn(rows, 2 * kv_heads, head_dim, generator=gen),
        "key_cache": torch.randn(num_blocks * PAGE, kv_heads, head_dim, generator=gen),
        "value_cache": torch.randn(num_blocks * PAGE, kv_heads, value_dim, generator=gen),
        "block_table": table.to(torch.int32),
        "lengths": torch.tensor(lengths, dtype=torch.int32),
        "new_key": 3 * torch.randn(rows, kv_heads, head_dim, generator=gen),
        "new_value": 3 * torch.randn(rows, kv_heads, value_dim, generator=gen),
        "write_slots": torch.tensor(slots, dtype=torch.int64),
    }
