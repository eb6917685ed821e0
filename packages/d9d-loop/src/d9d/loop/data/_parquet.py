"""Parquet files, read one record batch at a time (the ``parquet`` extra: pyarrow)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from d9d.loop._optional_import import import_extra
from d9d.loop.data._records import DataFileError, Record, RecordPosition


class ParquetReader:
    """Reads the rows of a Parquet file as records; a resume skips whole row groups by metadata.

    Args:
        path: The ``.parquet`` file.
        batch_rows: Rows decoded at a time (bounds memory).
    """

    def __init__(self, path: Path, *, batch_rows: int = 1024) -> None:
        self._path = path
        self._batch_rows = batch_rows

    @property
    def name(self) -> str:
        return str(self._path)

    def records(self, start: RecordPosition) -> Iterator[Record]:
        parquet: Any = import_extra("pyarrow.parquet", extra="parquet", feature="reading Parquet data")
        try:
            file: Any = parquet.ParquetFile(self._path)
        except (OSError, ValueError) as e:
            raise DataFileError(f"cannot read Parquet file {self._path}: {e}") from e
        index = 0
        for group in range(file.num_row_groups):
            rows = int(file.metadata.row_group(group).num_rows)
            if index + rows <= start.index:
                index += rows
                continue
            for batch in file.iter_batches(batch_size=self._batch_rows, row_groups=[group]):
                for row in batch.to_pylist():
                    if index >= start.index:
                        yield Record(
                            fields=row,
                            where=f"{self._path} row {index}",
                            next=RecordPosition(index=index + 1),
                        )
                    index += 1
