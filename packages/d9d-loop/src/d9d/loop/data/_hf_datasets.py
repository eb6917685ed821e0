"""Hugging Face ``datasets``: local files or Hub ids (the ``datasets`` extra)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from d9d.loop._optional_import import import_extra
from d9d.loop.data._records import DataFileError, Record, RecordPosition


class HFDatasetReader:
    """Reads a ``datasets`` split as records, streamed (``streaming=True``) so memory stays bounded.

    Args:
        path: A Hub id (``HuggingFaceH4/ultrachat_200k``) or a builder name (``json``, ``parquet``).
        split: The split (``train``).
        name: The dataset's configuration name, if it has several.
        data_files: Local files for a builder name (``path: json, data_files: [a.jsonl]``).
    """

    def __init__(self, *, path: str, split: str, name: str | None, data_files: list[str] | None) -> None:
        self._path = path
        self._split = split
        self._config_name = name
        self._data_files = data_files

    @property
    def name(self) -> str:
        return f"{self._path}[{self._split}]"

    def records(self, start: RecordPosition) -> Iterator[Record]:
        datasets: Any = import_extra("datasets", extra="datasets", feature="reading Hugging Face datasets")
        try:
            dataset: Any = datasets.load_dataset(
                self._path, self._config_name, split=self._split, data_files=self._data_files, streaming=True
            )
        except Exception as e:  # datasets raises many kinds (FileNotFoundError, its own, network)
            raise DataFileError(f"cannot load dataset {self.name}: {type(e).__name__}: {e}") from e
        if start.index:
            dataset = dataset.skip(start.index)
        index = start.index
        for row in dataset:
            if not isinstance(row, dict):
                raise DataFileError(f"{self.name} row {index}: expected a mapping, got {type(row).__name__}")
            fields = cast(dict[str, Any], row)
            yield Record(
                fields=fields, where=f"{self.name} row {index}", next=RecordPosition(index=index + 1)
            )
            index += 1
