"""Auxiliary-loss-free MoE balancing for a job: the routers' selection biases, kept equal on every rank.

The bias is the job's, not the architecture's: Hugging Face checkpoints have no tensor for it, so
it starts at zero, is left out of loading and export, and lives in d9d's training checkpoints
(a persistent buffer) so that a resumed run continues with it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from d9d.kernels.layers import MoELayer
from d9d.mesh import DistributedContext

_BIAS = "router.expert_bias"


def moe_layers(module: nn.Module) -> list[MoELayer]:
    """Every mixture-of-experts layer of ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def enable_expert_bias(module: nn.Module) -> None:
    """Gives every MoE router of ``module`` a selection bias (call on the meta-device stage).

    Raises:
        ValueError: If ``module`` has no MoE layer.
    """
    layers = moe_layers(module)
    if not layers:
        raise ValueError("model.expert_bias_update_rate is set but the model has no mixture-of-experts layer")
    for layer in layers:
        layer.router.enable_expert_bias()


def expert_bias_names(module: nn.Module) -> list[str]:
    """The state names of ``module``'s MoE selection biases (empty without them)."""
    return [name for name in module.state_dict(keep_vars=True) if name == _BIAS or name.endswith("." + _BIAS)]


@torch.no_grad()
def zero_expert_bias(module: nn.Module) -> None:
    """Sets every MoE selection bias of ``module`` to zero and clears the token counts."""
    for layer in moe_layers(module):
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.zero_()
        layer.tokens_per_expert.zero_()


@torch.no_grad()
def update_expert_bias(dist_context: DistributedContext, modules: Iterable[nn.Module], rate: float) -> None:
    """Moves every selection bias by ``rate`` from the step's token counts summed over the stage.

    The counts are summed over every rank that holds the same stage (data, context, expert and
    tensor ranks): ranks that saw other tokens contribute them, tensor-parallel ranks that saw
    the same tokens scale every count alike, which leaves ``sign(mean - count)`` unchanged. So
    every replica takes the same step, equal to one process's on the whole batch.
    """
    layers = [
        layer for module in modules for layer in moe_layers(module) if layer.router.expert_bias is not None
    ]
    if not layers:
        return
    counts = torch.stack([layer.tokens_per_expert for layer in layers])
    if dist_context.parameters.ranks_per_stage > 1:
        dist.all_reduce(counts, group=dist_context.stage_group())
    for layer, summed in zip(layers, counts, strict=True):
        layer.tokens_per_expert.copy_(summed)
        layer.update_expert_bias(rate)
