"""The one error a subcommand raises on bad input: printed without a traceback, exit status 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from d9d.loop._config_project import ConfigFileError, read_config_mapping


class CommandError(Exception):
    """Bad input to a ``d9d`` subcommand; the message names the file."""


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping (``read_config_mapping``, as a ``CommandError``).

    Raises:
        CommandError: If the file is missing, unreadable, empty, not YAML or not a mapping.
    """
    try:
        return read_config_mapping(path)
    except ConfigFileError as e:
        raise CommandError(str(e)) from e
