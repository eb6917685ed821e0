"""Forward on local tensors: DTensor parameters are swapped for their local tensors in forward.

A module whose parameters are DTensors can then run any PyTorch code (custom kernels included),
while the parameters the optimizer, the gradient synchronizer and checkpoints see stay DTensors.
Autograd links each local tensor to its DTensor parameter through ``DTensor.to_local``, whose
``grad_placements`` say what the local gradient means: ``Partial`` marks a gradient that still has
to be reduced over that mesh dim, which ``GradientSynchronizer`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils.hooks import RemovableHandle


@dataclass(frozen=True, kw_only=True)
class LocalParameterSlot:
    """One registered parameter to swap: ``owner.<name>``, with its gradient's meaning.

    Attributes:
        owner: The module that registers the parameter.
        name: The parameter's name in ``owner``.
        grad_placements: What the gradient of the tensor forward sees means, one placement per
            mesh dim: ``Partial`` for a gradient still to be reduced over that dim, or the
            parameter's own placement for one that is complete.
        grad_scale: Factor applied to the gradient of the tensor forward sees.
        gather: Forward sees the whole parameter (``full_tensor``: all-gathered over its shard
            dims, the gradient reduce-scattered back) instead of this rank's local tensor.
    """

    owner: nn.Module
    name: str
    grad_placements: tuple[Placement, ...]
    grad_scale: float = 1.0
    gather: bool = False


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_outputs[0] * ctx.scale, None


def _parameter_dict(module: nn.Module) -> dict[str, torch.Tensor | None]:
    # The registry nn.Module reads attributes from; FSDP swaps parameters through it the same way.
    return cast(dict[str, torch.Tensor | None], vars(module)["_parameters"])


def install_local_forward(module: nn.Module, slots: Sequence[LocalParameterSlot]) -> list[RemovableHandle]:
    """Makes ``module``'s forward see plain tensors for the DTensor parameters in ``slots``.

    This is the building block of d9d's strategies and of your own: place a parameter as any
    DTensor, then say what forward sees (local tensor or gathered whole) and what its gradient
    means; ``GradientSynchronizer`` and ``clip_grad_norm`` follow the placements.

    The swap is done on entry to ``module.forward`` and undone on exit (also on error). A slot
    whose current value is not a DTensor (already swapped by an enclosing module) is left alone.
    A parameter tied into several slots is converted once, so its gradients accumulate together.

    Returns:
        The hook handles (remove them to undo the installation).
    """
    frames: list[list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor]]] = []

    def swap_in(_module: nn.Module, _args: Any) -> None:
        swapped: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor]] = []
        local_by_id: dict[int, torch.Tensor] = {}
        for slot in slots:
            registry = _parameter_dict(slot.owner)
            value = registry.get(slot.name)
            if not isinstance(value, DTensor):
                continue
            local = local_by_id.get(id(value))
            if local is None:
                local = (
                    value.full_tensor(grad_placements=slot.grad_placements)
                    if slot.gather
                    else value.to_local(grad_placements=slot.grad_placements)
                )
                if slot.grad_scale != 1.0:
                    local = cast(torch.Tensor, _ScaleGradient.apply(local, slot.grad_scale))
                local_by_id[id(value)] = local
            registry[slot.name] = local
            swapped.append((registry, slot.name, value))
        frames.append(swapped)

    def swap_out(_module: nn.Module, _args: Any, _output: Any) -> None:
        if not frames:
            return
        for registry, name, value in reversed(frames.pop()):
            registry[name] = value

    return [
        module.register_forward_pre_hook(swap_in),
        module.register_forward_hook(swap_out, always_call=True),
    ]
