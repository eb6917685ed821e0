"""Parquet and Hugging Face datasets readers: the same records as JSONL, resumable at a position."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from d9d.loop.data import DataFileError, HFDatasetReader, ParquetReader, RecordPosition

ROWS = [{"text": f"sample {i}", "n": i} for i in range(10)]


def test_parquet_reads_rows_across_row_groups_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=3)
    records = list(ParquetReader(path, batch_rows=2).records(RecordPosition()))
    assert [dict(r.fields) for r in records] == ROWS
    resumed = list(ParquetReader(path).records(records[4].next))
    assert [r.fields["n"] for r in resumed] == list(range(5, 10))
    assert resumed[0].where == f"{path} row 5"


def test_parquet_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet")
    with pytest.raises(DataFileError, match=r"broken\.parquet"):
        list(ParquetReader(path).records(RecordPosition()))


def test_hf_datasets_reads_local_files_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    reader = HFDatasetReader(path="json", split="train", name=None, data_files=[str(path)])
    records = list(reader.records(RecordPosition()))
    assert [r.fields["n"] for r in records] == list(range(10))
    assert [r.fields["n"] for r in reader.records(records[6].next)] == [7, 8, 9]


def test_hf_datasets_error_names_the_dataset(tmp_path: Path) -> None:
    reader = HFDatasetReader(path="json", split="train", name=None, data_files=[str(tmp_path / "none.jsonl")])
    with pytest.raises(DataFileError, match=r"cannot load dataset json\[train\]"):
        list(reader.records(RecordPosition()))
