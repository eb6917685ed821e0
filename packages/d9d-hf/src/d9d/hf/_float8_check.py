"""``model.float8`` that would convert no layer is refused: FP8 asked for must mean FP8 run."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import cast

from torch import nn

from d9d.hf._model_config import Float8Config
from d9d.kernels.layers import MoELayer
from d9d.parallel import float8_linear_names


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    modules = cast(Iterator[tuple[str, nn.Module]], model.named_modules())
    return [(name, m) for name, m in modules if isinstance(m, nn.Linear)]


def refuse_float8_converting_nothing(model: nn.Module, config: Float8Config, *, model_name: str) -> None:
    """Raises when ``model.float8`` would leave every layer of this stage in high precision.

    Call before the conversion (on the meta-device stage). With ``experts`` the MoE experts
    convert whatever the linear layers do, so a stage holding them passes.

    Args:
        model: The stage about to be converted.
        config: The ``model.float8`` section.
        model_name: The model as the user named it (its source, or its family when built
            from scratch).

    Raises:
        ValueError: Naming the model, the ``exclude`` patterns and ``min_features`` that left
            every linear layer out, and what each left out.
    """
    training = config.training()
    if float8_linear_names(model, training):
        return
    if config.experts and any(isinstance(m, MoELayer) for m in model.modules()):
        return
    linears = _linears(model)
    patterns = [re.compile(p) for p in config.exclude]
    excluded = [name for name, _ in linears if any(p.search(name) for p in patterns)]
    kept = [(name, m) for name, m in linears if name not in excluded]
    unfiltered = dataclasses.replace(training, exclude=(), min_features=0)
    aligned = set(float8_linear_names(model, unfiltered))
    small = [name for name, _ in kept if name in aligned]
    widest = max((min(m.in_features, m.out_features) for name, m in kept if name in aligned), default=0)
    raise ValueError(
        f"model.float8 converts no linear layer of {model_name} ({type(model).__name__}, "
        f"{len(linears)} linear layers): {len(excluded)} match model.float8.exclude "
        f"{list(config.exclude)}, {len(small)} are below model.float8.min_features={config.min_features} "
        f"(the widest has {widest} features), {len(kept) - len(small)} have dims that are not multiples "
        "of 16. Lower min_features, narrow exclude, or remove model.float8"
    )
