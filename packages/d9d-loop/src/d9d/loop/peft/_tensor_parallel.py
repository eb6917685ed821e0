"""LoRA adapters laid out like their tensor-parallel base layer."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from d9d.loop.peft._inject import named_modules
from d9d.loop.peft._lora import LoRALinear


def _adapter_placements(weight: Placement) -> tuple[Placement, Placement]:
    """``(A, B)`` placements for one mesh dim of a base ``weight`` of shape ``(out, in)``."""
    if isinstance(weight, Shard) and weight.dim in (0, -2):  # column parallel: out is split
        return Replicate(), Shard(0)
    if isinstance(weight, Shard) and weight.dim in (1, -1):  # row parallel: in is split
        return Shard(1), Replicate()
    if isinstance(weight, Replicate):
        return Replicate(), Replicate()
    raise ValueError(f"no LoRA adapter layout for a base weight placed {weight}")


def _place(module: nn.Module, name: str, weight: DTensor, placements: list[Placement]) -> None:
    adapter = module.get_parameter(name)
    mesh = weight.device_mesh
    if isinstance(adapter, DTensor) and adapter.device_mesh == mesh and not adapter.is_meta:
        placed: torch.Tensor = adapter.redistribute(mesh, placements).detach()
    else:
        # a plain tensor (the same on every rank), or a meta one (no values to move)
        full = adapter.full_tensor() if isinstance(adapter, DTensor) and not adapter.is_meta else adapter
        if full.is_meta:
            full = torch.empty(adapter.shape, dtype=adapter.dtype, device="meta")
        placed = distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)
    module.register_parameter(name, nn.Parameter(placed, requires_grad=adapter.requires_grad))


def place_adapters_like_base(model: nn.Module) -> list[str]:
    """Lays out every ``LoRALinear``'s adapters after its tensor-parallel base weight.

    torch's ``ColwiseParallel`` shards every parameter of a linear layer ``Shard(0)`` (right for
    ``lora_B``, wrong for ``lora_A``) and ``RowwiseParallel`` only ``weight`` and ``bias``. Call
    this after ``parallelize_module`` (and before FSDP): per mesh dim, a column-parallel base
    (weight ``Shard(0)``) gets ``A`` replicated and ``B`` ``Shard(0)`` (split like the outputs); a
    row-parallel base (weight ``Shard(1)``) gets ``A`` ``Shard(1)`` (split like the inputs) and
    ``B`` replicated, so the update is a partial sum reduced with the base's. Values are kept
    (a plain adapter is taken as the same on every rank).

    Returns:
        The names of the layers whose adapters were placed (those with a DTensor weight).
    """
    placed: list[str] = []
    for name, module in named_modules(model):
        if not isinstance(module, LoRALinear):
            continue
        weight = module.weight
        if not isinstance(weight, DTensor):
            continue
        pairs = [_adapter_placements(p) for p in weight.placements]
        try:
            _place(module, "lora_A", weight, [a for a, _ in pairs])
            _place(module, "lora_B", weight, [b for _, b in pairs])
        except ValueError as e:
            raise ValueError(f"peft: layer '{name}': {e}") from e
        placed.append(name)
    return placed
