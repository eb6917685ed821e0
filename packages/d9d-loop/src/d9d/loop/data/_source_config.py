"""Where samples come from: a JSONL or Parquet file, or a Hugging Face dataset (config and reader)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from d9d.loop.data._hf_datasets import HFDatasetReader
from d9d.loop.data._jsonl import JsonlReader
from d9d.loop.data._parquet import ParquetReader
from d9d.loop.data._records import RecordReader


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JsonlSourceConfig(_Strict):
    """A JSON Lines file: one JSON object per line.

    Attributes:
        path: The file.
    """

    kind: Literal["jsonl"] = "jsonl"
    path: Path


class ParquetSourceConfig(_Strict):
    """A Parquet file (needs the ``parquet`` extra); each row is a sample.

    Attributes:
        path: The file.
    """

    kind: Literal["parquet"] = "parquet"
    path: Path


class HFDatasetSourceConfig(_Strict):
    """A Hugging Face ``datasets`` split (needs the ``datasets`` extra), read as a stream.

    Attributes:
        path: A Hub id or a builder name (``json``, ``parquet``, ``csv``) with ``data_files``.
        split: The split to read.
        name: The dataset's configuration, where it has several.
        data_files: Local files for a builder name.
    """

    kind: Literal["hf_datasets"] = "hf_datasets"
    path: str
    split: str = "train"
    name: str | None = None
    data_files: list[str] | None = None


def _from_shorthand(value: Any) -> Any:
    """A bare path stands for a file source picked by its suffix (``data/chat.jsonl``)."""
    if not isinstance(value, str | Path):
        return value
    path = Path(value)
    match path.suffix:
        case ".jsonl" | ".json":
            return {"kind": "jsonl", "path": path}
        case ".parquet":
            return {"kind": "parquet", "path": path}
        case _:
            raise ValueError(
                f"source {value!r}: a bare path must end in .jsonl or .parquet; otherwise write "
                "{kind: jsonl|parquet|hf_datasets, path: ...}"
            )


DataSourceConfig = Annotated[
    Annotated[JsonlSourceConfig | ParquetSourceConfig | HFDatasetSourceConfig, Field(discriminator="kind")],
    BeforeValidator(_from_shorthand),
]
"""One of the sources, by ``kind``; a bare ``.jsonl`` / ``.parquet`` path is accepted as well."""


def open_source(config: JsonlSourceConfig | ParquetSourceConfig | HFDatasetSourceConfig) -> RecordReader:
    """The reader of a configured source."""
    match config:
        case JsonlSourceConfig():
            return JsonlReader(config.path)
        case ParquetSourceConfig():
            return ParquetReader(config.path)
        case HFDatasetSourceConfig():
            return HFDatasetReader(
                path=config.path, split=config.split, name=config.name, data_files=config.data_files
            )
