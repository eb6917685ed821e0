"""Imports of optional extras, with an error that says which extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """A chosen feature needs a package of an extra that is not installed; names the extra."""


def import_extra(module: str, *, extra: str, feature: str) -> ModuleType:
    """Imports ``module`` or raises ``MissingExtraError`` naming ``extra``.

    Args:
        module: The module to import (``wandb``).
        extra: The extra of d9d-loop (and the d9d meta-package) that installs it.
        feature: What needs it, for the message (``the wandb tracker``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{feature} needs the '{module}' package, which is not installed: "
            f"pip install 'd9d-loop[{extra}]' (or 'd9d[{extra}]')"
        ) from e
