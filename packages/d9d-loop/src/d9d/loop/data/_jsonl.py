"""JSON Lines: one JSON object per line, read in a stream from any byte offset."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from d9d.loop.data._records import DataFileError, Record, RecordPosition


class JsonlReader:
    """Reads one JSON object per line; blank lines are skipped, anything else is an error.

    Args:
        path: The ``.jsonl`` file.
    """

    def __init__(self, path: Path) -> None:
        self._path = path

    @property
    def name(self) -> str:
        return str(self._path)

    def records(self, start: RecordPosition) -> Iterator[Record]:
        try:
            handle = self._path.open("rb")
        except OSError as e:
            raise DataFileError(f"cannot read data file {self._path}: {e.strerror or e}") from e
        with handle:
            handle.seek(start.offset)
            index, offset, line = start.index, start.offset, start.line
            for raw in handle:
                offset += len(raw)
                line += 1
                if not raw.strip():
                    continue
                where = f"{self._path}:{line}"
                try:
                    value: Any = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataFileError(f"{where}: not valid JSON: {e}") from e
                if not isinstance(value, dict):
                    raise DataFileError(f"{where}: expected a JSON object, got {type(value).__name__}")
                fields = cast(dict[str, Any], value)
                index += 1
                yield Record(
                    fields=fields, where=where, next=RecordPosition(index=index, offset=offset, line=line)
                )
