"""The identity mapper graph of a module's state dict."""

from __future__ import annotations

from torch import nn

from d9d.state_mappers._group import StateMapper
from d9d.state_mappers._rename import SelectMapper


def identity_mapper_from_module(module: nn.Module) -> StateMapper:
    """One identity group per entry of ``module.state_dict()`` (parameters and persistent buffers).

    Works on a module on the meta device or with DTensor parameters: only names are read.
    """
    return SelectMapper(module.state_dict().keys())
