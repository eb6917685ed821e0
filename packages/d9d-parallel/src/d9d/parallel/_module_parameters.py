"""Enumerates the parameters a module registers, with their owning submodule."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

from torch import nn


@dataclass(frozen=True, kw_only=True)
class OwnedParameter:
    """A parameter as ``owner.<name>``; ``qualified_name`` is its path from the root module."""

    owner: nn.Module
    name: str
    qualified_name: str
    parameter: nn.Parameter


def owned_parameters(module: nn.Module) -> list[OwnedParameter]:
    """Every (owner, name) registration under ``module``, tied parameters listed once per owner."""
    found: list[OwnedParameter] = []
    modules = cast(Iterator[tuple[str, nn.Module]], module.named_modules(remove_duplicate=False))
    for prefix, owner in modules:
        for name, parameter in owner.named_parameters(recurse=False):
            qualified = f"{prefix}.{name}" if prefix else name
            found.append(
                OwnedParameter(owner=owner, name=name, qualified_name=qualified, parameter=parameter)
            )
    return found


def require_parameters(module: nn.Module, *, purpose: str) -> None:
    """Raises if ``module`` has no parameters, naming its class."""
    if next(iter(module.parameters()), None) is None:
        raise ValueError(f"{purpose}: module {type(module).__name__} has no parameters to distribute")
