"""The one error a subcommand raises on bad input (one line, exit status 2) and the checks raising it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from d9d.loop.config._project import ConfigFileError, read_config_mapping


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


def check_output_file(path: Path, suffixes: tuple[str, ...]) -> None:
    """Checks, before any work, that ``path`` can be written as one of ``suffixes``.

    Raises:
        CommandError: If its folder does not exist or its suffix is not one of ``suffixes``.
    """
    if path.suffix.lower() not in suffixes:
        shown = path.suffix or "no suffix"
        raise CommandError(f"cannot write {path}: {shown} is not one of {', '.join(suffixes)}")
    if not path.parent.is_dir():
        raise CommandError(f"cannot write {path}: its folder {path.parent} does not exist")
