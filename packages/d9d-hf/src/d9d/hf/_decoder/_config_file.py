"""Reading and writing config.json: validated against a family's (or every family's) pydantic model."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import pydantic

CONFIG_FILE = "config.json"

_Config = TypeVar("_Config")


def read_config_file(directory: Path | str, adapter: pydantic.TypeAdapter[_Config], *, what: str) -> _Config:
    """Reads and validates ``directory/config.json`` with ``adapter``.

    Args:
        directory: The checkpoint directory.
        adapter: The config model(s) the file must fit.
        what: The accepted configs, for the error message (``"Qwen3 / Qwen3-MoE"``).

    Raises:
        FileNotFoundError: If there is no config.json.
        ValueError: Naming the file and every offending field: another ``model_type`` or
            ``architectures``, an unknown field, a value d9d does not implement.
    """
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{path}: no config.json") from error
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from error
    try:
        return adapter.validate_python(raw)
    except pydantic.ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or '<root>'}: {e['msg']}" for e in error.errors()
        )
        raise ValueError(f"{path}: not a supported {what} config: {problems}") from error


def write_config(directory: Path, content: dict[str, Any]) -> None:
    """Writes ``directory/config.json`` atomically (a temporary file renamed into place)."""
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".config.", suffix=".json")
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(content, file, indent=2, sort_keys=True)
            file.write("\n")
        Path(temporary).replace(directory / CONFIG_FILE)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
