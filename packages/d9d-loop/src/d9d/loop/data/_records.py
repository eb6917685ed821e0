"""Records read from a data file: the fields of one sample and where it came from."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from d9d.loop._providers import DataError


class DataFileError(DataError):
    """A data file cannot be used; the message names the file and, where there is one, the line."""


@dataclass(kw_only=True, frozen=True)
class RecordPosition:
    """Where a reader continues: the record's index, and its byte offset where the format has one.

    Attributes:
        index: Records before this one in the source (0-based).
        offset: Byte offset of the record in the file (JSONL), so a resume seeks instead of
            re-reading; 0 where the format has none (its readers skip ``index`` records).
        line: Lines before the record (JSONL), so messages after a resume name the right line.
    """

    index: int = 0
    offset: int = 0
    line: int = 0


@dataclass(kw_only=True, frozen=True)
class Record:
    """One sample's fields.

    Attributes:
        fields: The sample (a JSON object, a Parquet row, a ``datasets`` row).
        where: ``file:line`` (or ``source[index]``) for messages.
        next: The position just after this record (what a resume continues from).
    """

    fields: Mapping[str, Any]
    where: str
    next: RecordPosition


class RecordReader(Protocol):
    """A source of records that can start at any saved position (JSONL, Parquet, ``datasets``)."""

    @property
    def name(self) -> str:
        """The source as the user named it (a path or a dataset id), for messages."""
        ...

    def records(self, start: RecordPosition) -> Iterator[Record]:
        """The records from ``start`` to the end, in order.

        Raises:
            DataFileError: On a record that is not an object (naming the file and line).
        """
        ...
