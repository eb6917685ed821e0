"""The one error a subcommand raises on bad input: printed without a traceback, exit status 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import yaml


class CommandError(Exception):
    """Bad input to a ``d9d`` subcommand; the message names the file."""


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping.

    Raises:
        CommandError: If the file is missing, unreadable, empty, not YAML or not a mapping.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise CommandError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        raw: Any = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CommandError(f"{path} is not valid YAML: {e}") from e
    if raw is None:
        raise CommandError(f"{path} is empty")
    if not isinstance(raw, dict):
        raise CommandError(f"{path} must be a mapping of sections, not {type(raw).__name__}")
    return cast(dict[str, Any], raw)
