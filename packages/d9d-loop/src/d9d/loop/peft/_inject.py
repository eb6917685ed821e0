"""Applying a ``PeftConfig`` to a model stage: adapters in, everything else frozen."""

from __future__ import annotations

import re

import torch
from torch import nn

from d9d.loop.peft._config import FullFineTuningConfig, LoRAConfig, PeftConfig
from d9d.loop.peft._grouped import GroupedLoRAExperts, grouped_weight_names
from d9d.loop.peft._lora import LoRALinear


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every submodule with its qualified name (the root as ``""``), walked through ``named_children``."""
    named: list[tuple[str, nn.Module]] = [("", model)]
    for child_name, child in model.named_children():
        named += [(f"{child_name}.{n}" if n else child_name, m) for n, m in named_modules(child)]
    return named


class LoRATargetError(ValueError):
    """A LoRA target pattern matched no linear layer of a stage."""


def inject_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Replaces every ``nn.Linear`` whose name matches ``config.target`` by a ``LoRALinear``, and
    every grouped-experts module (direct 3-d ``(E, in, out)`` weights, see ``GroupedExperts``)
    with a matching ``<module>.<weight>`` name by a ``GroupedLoRAExperts`` adapting those weights.

    Works on the meta device (before parallelization and initialization); the new layer keeps
    the base layer's device and dtype. Then freezes every parameter but the adapters and those
    matching ``config.trainable``.

    Returns:
        The names of the adapted layers.

    Raises:
        LoRATargetError: When the pattern matches no linear layer (naming the pattern and some
            of the linear layers it could have matched).
        ValueError: When ``r`` exceeds a matched layer's smaller side.
    """
    pattern = re.compile(config.target)
    linears = [(n, m) for n, m in named_modules(model) if type(m) is nn.Linear]
    chosen = [(n, m) for n, m in linears if pattern.search(n)]
    grouped = [
        (n, m, [w for w in grouped_weight_names(m) if pattern.search(f"{n}.{w}" if n else w)])
        for n, m in named_modules(model)
        if not isinstance(m, nn.Linear)
    ]
    grouped = [(n, m, w) for n, m, w in grouped if w]
    if not chosen and not grouped:
        some = ", ".join(n for n, _ in linears[:8]) or "none"
        raise LoRATargetError(
            f"peft.target={config.target!r} matches no linear layer of {type(model).__name__} "
            f"(its linear layers: {some})"
        )
    for name, base in chosen:
        _replace(model, name, _adapted_linear(name, base, config))
    for name, base, weights in grouped:
        if config.dropout > 0:
            raise ValueError(
                f"peft: layer '{name}': LoRA on grouped expert weights has no dropout "
                f"(peft.dropout={config.dropout}); set dropout: 0 or narrow peft.target"
            )
        try:
            grouped_adapted = GroupedLoRAExperts(base, weights, r=config.r, alpha=config.alpha)
        except ValueError as e:
            raise ValueError(f"peft: layer '{name}': {e}") from e
        _replace(model, name, grouped_adapted)
    trainable = re.compile(config.trainable) if config.trainable is not None else None
    for name, parameter in model.named_parameters():
        is_adapter = name.endswith(("lora_A", "lora_B"))
        parameter.requires_grad_(is_adapter or (trainable is not None and bool(trainable.search(name))))
    return [n for n, _ in chosen] + [n for n, _, _ in grouped]


def _adapted_linear(name: str, base: nn.Linear, config: LoRAConfig) -> LoRALinear:
    """A fresh ``LoRALinear`` of ``base``'s shape, device and dtype (naming the layer in errors)."""
    try:
        return LoRALinear(
            base.in_features,
            base.out_features,
            bias="bias" in dict(base.named_parameters(recurse=False)),
            r=config.r,
            alpha=config.alpha,
            dropout=config.dropout,
            device=base.weight.device,
            dtype=base.weight.dtype,
        )
    except ValueError as e:
        raise ValueError(f"peft: layer '{name}': {e}") from e


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    if not parent_name and not child:
        raise ValueError("peft: the root module itself cannot be replaced by an adapted layer")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def apply_peft(model: nn.Module, config: PeftConfig) -> None:
    """Applies ``config`` to a stage built on the meta device (full fine-tuning changes nothing)."""
    match config:
        case FullFineTuningConfig():
            return
        case LoRAConfig():
            inject_lora(model, config)


def reset_adapters(model: nn.Module) -> None:
    """Gives every adapter its initial value (after the base weights were loaded from a source)."""
    for module in model.modules():
        if isinstance(module, LoRALinear | GroupedLoRAExperts):
            module.reset_lora_parameters()


def trainable_names(model: nn.Module) -> set[str]:
    """Names of the parameters that train (what an adapters-only checkpoint holds)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def is_adapter(name: str) -> bool:
    """Whether a state name is a LoRA adapter's (``....lora_A`` or ``....lora_B``)."""
    return name.endswith((".lora_A", ".lora_B")) or name in ("lora_A", "lora_B")


def without_adapters(model: nn.Module) -> nn.Module:
    """A module tree holding ``model``'s own tensors under their names, adapters left out.

    The same parameter and buffer objects (sharded ones stay sharded), so loading a base
    checkpoint into the view fills the model's base weights, and the view's ``state_dict()`` is
    what the model had before its adapters went in.
    """
    return view_of({k: v for k, v in model.state_dict(keep_vars=True).items() if not is_adapter(k)})


@torch.no_grad()
def merged_view(model: nn.Module) -> nn.Module:
    """A module tree with the plain model's state: each adapted ``weight`` is a new tensor
    ``W + scale * B @ A`` (a DTensor where the layer is sharded), adapters left out, every other
    tensor ``model``'s own. Export saves it through the provider's export mapper."""
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if not is_adapter(k)}
    for name, module in named_modules(model):
        if isinstance(module, LoRALinear):
            key = f"{name}.weight" if name else "weight"
            state[key] = module.merged_weight().detach()
        elif isinstance(module, GroupedLoRAExperts):
            for weight, value in module.merged_weights().items():
                state[f"{name}.{weight}" if name else weight] = value.detach()
    return view_of(state)


def view_of(state: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree holding ``state``'s tensors under their dotted names (parameters stay
    parameters, the rest are buffers)."""
    view = nn.Module()
    for name, tensor in state.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = view
        for part in parent_name.split(".") if parent_name else []:
            child = dict(parent.named_children()).get(part)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        if isinstance(tensor, nn.Parameter):
            parent.register_parameter(leaf, tensor)
        else:
            parent.register_buffer(leaf, tensor)
    return view


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with every adapter folded into its base weight (``W + scale * B @ A``)
    and the adapter tensors left out: the plain model's state (unsharded modules only)."""
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(("lora_A", "lora_B"))}
    for name, module in named_modules(model):
        if isinstance(module, LoRALinear):
            key = f"{name}.weight" if name else "weight"
            state[key] = module.merged_weight()
        elif isinstance(module, GroupedLoRAExperts):
            for weight in module.adapted:
                key = f"{name}.{weight}" if name else weight
                state[key] = module.merged_weights()[weight]
    return state
