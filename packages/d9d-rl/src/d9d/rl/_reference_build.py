"""Builds a reference stage the way d9d-loop builds the policy's, and gives it its values."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.loop import (
    InitializeModelStageContext,
    LoadModelStageContext,
    ModelProvider,
    ParallelizeModelStageContext,
    StagesReadyContext,
)
from d9d.mesh import DistributedContext
from d9d.pipeline import PipelineStageInfo


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by every name (tied copies and non-persistent buffers too)."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    return tensors


def check_same_tensors(reference: nn.Module, policy: nn.Module) -> None:
    """Refuses a reference whose tensors differ from the policy's in name or (global) shape.

    Raises:
        ValueError: Naming the first tensor that differs (or is missing on one side).
    """
    ours = _named_tensors(reference)
    theirs = _named_tensors(policy)
    for name in sorted(set(ours) | set(theirs)):
        if name not in theirs or name not in ours:
            side = "the policy" if name not in theirs else "the reference"
            raise ValueError(f"reference model tensor '{name}' is missing in {side}: the models differ")
        if tuple(ours[name].shape) != tuple(theirs[name].shape):
            raise ValueError(
                f"reference model tensor '{name}' has shape {tuple(ours[name].shape)}, the policy's "
                f"{tuple(theirs[name].shape)}: the reference must have the policy's architecture"
            )


@torch.no_grad()
def _copy_from_policy(reference: nn.Module, policy: nn.Module) -> None:
    """Copies the policy's values shard by shard (same placements: no communication)."""
    theirs = _named_tensors(policy)
    for name, tensor in _named_tensors(reference).items():
        _local(tensor).copy_(_local(theirs[name]))


def build_reference_stage(
    provider: ModelProvider[Any], *, dist_context: DistributedContext, policy: nn.Module
) -> nn.Module:
    """The reference's one stage: built on meta, parallelized, materialized, checked, then filled.

    Values come from ``provider.load_model_stage`` when it loads (its own checkpoint), else from
    ``policy``'s current weights.

    Raises:
        ValueError: If a tensor's name or shape differs from the policy's, before any value is
            read.
    """
    stage = PipelineStageInfo(current_stage=0, num_stages=1)
    with torch.device("meta"):
        model = provider.initialize_model_stage(
            InitializeModelStageContext(dist_context=dist_context, stage=stage)
        ).model
    provider.parallelize_model_stage(
        ParallelizeModelStageContext(dist_context=dist_context, stage=stage, model=model)
    )
    check_same_tensors(model, policy)
    model.to_empty(device=dist_context.device)
    loaded = provider.load_model_stage(
        LoadModelStageContext(dist_context=dist_context, stage=stage, model=model)
    ).loaded
    if not loaded:
        _copy_from_policy(model, policy)
    provider.stages_ready(StagesReadyContext(dist_context=dist_context, stages=[(stage, model)]))
    return model
