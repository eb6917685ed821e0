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
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, cast

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


def float8_linear_names(module: nn.Module, config: Float8Training) -> list[str]:
    """The qualified names of the ``nn.Linear`` layers ``convert_to_float8`` would convert.

    A layer converts when it is exactly an ``nn.Linear`` (not a subclass), no ``exclude``
    pattern matches its name, both its dims are multiples of 16 and its smaller dim is at least
    ``min_features``.

    Raises:
        ValueError: If a layer that passes the name and size rules is a subclass of
            ``nn.Linear`` (a LoRA layer, say): torchao would replace it by a plain float8 linear
            and drop what the subclass adds. Exclude it by name, or leave it out of FP8.
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
        if type(child) is not nn.Linear:
            if type(child).__name__ == "Float8Linear":
                raise ValueError(f"convert_to_float8: layer {name!r} is already a Float8Linear")
            raise ValueError(
                f"convert_to_float8: layer {name!r} is a {type(child).__name__}, a subclass of "
                "nn.Linear; torchao's float8 conversion would drop what it adds (e.g. LoRA "
                "adapters). Add its name to exclude, or train it without float8"
            )
        chosen.append(name)
    return chosen


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
    chosen = frozenset(names)

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
