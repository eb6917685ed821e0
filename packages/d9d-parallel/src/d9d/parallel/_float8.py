"""FP8 training of linear layers through torchao (``Float8Linear``); MoE experts: ``_float8_experts``.

torchao is an optional dependency (``pip install 'd9d-parallel[float8]'``), imported only when a
function here runs. Converted layers keep their parameters under the same names and in the same
(master) dtype; only their matmuls run in float8, so state dicts, checkpoints and exports are
unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Protocol, cast

import torch
from torch import nn

Float8Recipe = Literal["tensorwise", "rowwise"]
"""torchao's scaling recipes: one scale per tensor, or one per row (per column of the weight)."""

_FP8_ALIGNMENT = 16  # float8 GEMMs need both dims of every operand to be multiples of 16

DEFAULT_FLOAT8_EXCLUDE: tuple[str, ...] = (r"\blm_head\b", r"\brouter\b", r"\bgate\b")
"""Layers left in high precision by default: the LM head and MoE routers (HF names a router
``mlp.gate``; ``gate_proj`` does not match)."""


class MissingFloat8Error(ImportError):
    """FP8 training was asked for but torchao is not installed."""


def _import_torchao(module: str = "torchao.float8") -> ModuleType:
    """Imports a torchao module, or raises ``MissingFloat8Error`` naming the extra to install.

    Args:
        module: The torchao module (``torchao.float8`` by default).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingFloat8Error(
            f"float8 training needs torchao ('import {module}' failed: {e}); "
            "pip install 'd9d-parallel[float8]' (or 'd9d[float8]')"
        ) from e


@dataclass(kw_only=True, frozen=True)
class Float8Training:
    """Which linear layers train in FP8 and how.

    Attributes:
        recipe: ``"tensorwise"`` (one scale per tensor; the fastest on H100/H200) or ``"rowwise"``
            (one scale per row; closer to bf16 numerics).
        fsdp_float8_all_gather: FSDP all-gathers the weights in float8 (half the bytes of bf16);
            tensorwise only. Call ``precompute_float8_scales`` after every optimizer step.
        exclude: Regular expressions searched in each layer's qualified name; a match stays in
            high precision.
        min_features: Layers whose smaller dim is below this stay in high precision (their
            casts cost more than the FP8 matmul saves). Dims that are not multiples of 16
            always do (a hardware requirement).
        emulate: Emulate the FP8 matmuls in high precision (tests without FP8 hardware).
    """

    recipe: Float8Recipe = "tensorwise"
    fsdp_float8_all_gather: bool = False
    exclude: tuple[str, ...] = DEFAULT_FLOAT8_EXCLUDE
    min_features: int = 128
    emulate: bool = False

    def __post_init__(self) -> None:
        match self.recipe:
            case "tensorwise":
                pass
            case "rowwise":
                if self.fsdp_float8_all_gather:
                    raise ValueError(
                        "fsdp_float8_all_gather needs recipe='tensorwise' (torchao gathers float8 "
                        "weights with one scale per tensor); turn it off for recipe='rowwise'"
                    )
        if self.min_features < 0:
            raise ValueError(f"min_features must be >= 0, got {self.min_features}")
        for pattern in self.exclude:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"exclude pattern {pattern!r} is not a regular expression: {e}") from e


def _named_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return cast(Iterator[tuple[str, nn.Module]], module.named_modules())


def _float8_linear_type() -> type[nn.Module]:
    linear: type[nn.Module] = _import_torchao("torchao.float8.float8_linear").Float8Linear
    return linear


class _AdaptedLinear(Protocol):
    base_linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _has_base_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` subclass that runs its base product through a ``base_linear`` slot
    (d9d-loop's ``LoRALinear``): FP8 replaces the slot and keeps the subclass."""
    return callable(getattr(module, "base_linear", None))


def float8_linear_names(module: nn.Module, config: Float8Training) -> list[str]:
    """The qualified names of the ``nn.Linear`` layers ``convert_to_float8`` would convert.

    A layer converts when it is an ``nn.Linear`` (a subclass only if it has a ``base_linear``
    slot, as LoRA layers do), no ``exclude`` pattern matches its name, both its dims are
    multiples of 16 and its smaller dim is at least ``min_features``.

    Raises:
        ValueError: If a layer that passes the name and size rules is a subclass of
            ``nn.Linear`` without a ``base_linear`` slot: torchao would replace it by a plain
            float8 linear and drop what the subclass adds. Exclude it by name, or leave it out
            of FP8.
    """
    patterns = [re.compile(p) for p in config.exclude]
    chosen: list[str] = []
    for name, child in _named_modules(module):
        if not isinstance(child, nn.Linear) or any(p.search(name) for p in patterns):
            continue
        out_features, in_features = child.out_features, child.in_features
        if out_features % _FP8_ALIGNMENT or in_features % _FP8_ALIGNMENT:
            continue
        if min(out_features, in_features) < config.min_features:
            continue
        if type(child) is not nn.Linear and not _has_base_linear(child):
            if type(child).__name__ == "Float8Linear":
                raise ValueError(f"convert_to_float8: layer {name!r} is already a Float8Linear")
            raise ValueError(
                f"convert_to_float8: layer {name!r} is a {type(child).__name__}, a subclass of "
                "nn.Linear without a base_linear slot; torchao's float8 conversion would drop what "
                "it adds. Add its name to exclude, or train it without float8"
            )
        if isinstance(getattr(child, "base_linear", None), Float8BaseLinear):
            raise ValueError(f"convert_to_float8: layer {name!r} already runs its base product in float8")
        chosen.append(name)
    return chosen


class Float8BaseLinear:
    """The base product of an adapted linear layer (``base_linear`` slot) in FP8 through torchao.

    Runs torchao's ``Float8Linear`` forward with the layer's current ``weight`` and ``bias``
    (``torch.func.functional_call`` on a meta-device template), so FSDP's gathered or TP's
    sharded parameters are the ones multiplied, and nothing is registered on the layer. FSDP
    gathers such weights in bf16 (``fsdp_float8_all_gather`` applies to plain layers only).

    Args:
        layer: The adapted layer (its sizes and whether it has a bias).
        config: Recipe; ``fsdp_float8_all_gather`` is ignored here.
    """

    def __init__(self, layer: nn.Linear, config: Float8Training) -> None:
        torchao_config = dataclasses.replace(_torchao_config(config), enable_fsdp_float8_all_gather=False)
        bias = cast(nn.Parameter | None, layer.bias)  # None where the layer has no bias
        with torch.device("meta"):
            plain = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None)
        float8_linear: Any = _float8_linear_type()
        self._template: nn.Module = float8_linear.from_float(plain, config=torchao_config)

    def __call__(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(input, weight, bias)`` with the product in float8."""
        parameters = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
        output = torch.func.functional_call(self._template, parameters, (input,))
        return cast(torch.Tensor, output)


def _torchao_config(config: Float8Training) -> Any:
    float8 = _import_torchao()
    recipe_config = float8.Float8LinearConfig.from_recipe_name(config.recipe)
    return dataclasses.replace(
        recipe_config,
        enable_fsdp_float8_all_gather=config.fsdp_float8_all_gather,
        emulate=config.emulate,
    )


def convert_to_float8(module: nn.Module, config: Float8Training) -> list[str]:
    """Swaps the chosen ``nn.Linear`` layers of ``module`` for torchao's ``Float8Linear``, in place.

    Subclasses with a ``base_linear`` slot (LoRA layers) stay what they are: their slot gets a
    ``Float8BaseLinear``, so the frozen base product runs in float8 and the adapters in the
    compute dtype.

    Call it on the meta-device model before tensor parallelism, activation checkpointing's
    rerun, ``torch.compile`` and FSDP (torchao's order): each converted layer keeps its
    ``weight`` and ``bias`` parameters (same names, same dtype), so loading, checkpoints and
    export see no difference; forward and backward cast input, weight and gradient to float8 and
    multiply with ``torch._scaled_mm``. Which layers: see ``float8_linear_names``.

    With ``fsdp_float8_all_gather`` the weights become torchao's float8-castable tensors that
    FSDP gathers in float8; call ``precompute_float8_scales`` after each optimizer step.

    Args:
        module: The model or one stage, on any device (meta included).
        config: Recipe and layer filter.

    Returns:
        The qualified names of the converted layers.

    Raises:
        MissingFloat8Error: If torchao is not installed.
        ValueError: If ``module`` itself is a linear layer to convert, or a chosen layer is a
            subclass of ``nn.Linear`` (see ``float8_linear_names``).
    """
    float8 = _import_torchao()
    names = float8_linear_names(module, config)
    if "" in names:
        raise ValueError("convert_to_float8: call it on a module that holds the linear layers, not on one")
    adapted = {name for name in names if type(module.get_submodule(name)) is not nn.Linear}
    for name in adapted:
        layer = cast(nn.Linear, module.get_submodule(name))
        cast(_AdaptedLinear, layer).base_linear = Float8BaseLinear(layer, config)
    chosen = frozenset(names) - adapted

    def module_filter(_child: nn.Module, name: str) -> bool:
        return name in chosen

    if chosen:
        float8.convert_to_float8_training(
            module, module_filter_fn=module_filter, config=_torchao_config(config)
        )
    return names


def precompute_float8_scales(module: nn.Module) -> None:
    """Computes the float8 scales of every FSDP-sharded float8-gathered weight with one all-reduce.

    Run after each optimizer step when ``fsdp_float8_all_gather`` is on (the next forward's
    all-gathers then cast without an all-reduce of their own); does nothing for a module without
    such weights. Every rank of the weights' mesh must call it.
    """
    float8 = _import_torchao()
    linear = _float8_linear_type()
    if any(isinstance(m, linear) for m in module.modules()):
        float8.precompute_float8_dynamic_scale_for_fsdp(module)
