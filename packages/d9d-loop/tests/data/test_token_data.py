"""Token data: JSONL reading with named errors, packing, bucketing, streaming resume and sharding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from d9d.loop import DataConfig, DataProviderContext
from d9d.loop.data import (
    DataFileError,
    DataReport,
    JsonlReader,
    PaddingCollator,
    Record,
    RecordPosition,
    RowBatch,
    SampleError,
    StreamingBatchSource,
    TokenDataConfig,
    TokenDataProvider,
    TokenRow,
    bucketed_batches,
    fit_length,
    pack_rows,
    stack_rows,
)
from d9d.mesh import DistributedContext, MeshParameters


class WordEncoder:
    """Each word is a token whose id is its length; a record needs a ``text`` field."""

    pad_id = 0

    def encode(self, record: Record) -> TokenRow:
        text = record.fields.get("text")
        if not isinstance(text, str):
            raise SampleError(f"{record.where}: missing field 'text'")
        ids = [len(word) for word in text.split()]
        return TokenRow(input_ids=ids, labels=ids, where=record.where)


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _texts(n: int, seed: int = 0) -> list[dict[str, str]]:
    return [
        {"text": " ".join("w" * (1 + (i * 7 + k + seed) % 5) for k in range(1 + (i * 3) % 9))}
        for i in range(n)
    ]


def test_jsonl_errors_name_the_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"text": "a"}, "", "{not json", {"text": "b"}])
    with pytest.raises(DataFileError, match=r"d\.jsonl:3: not valid JSON"):
        list(JsonlReader(path).records(RecordPosition()))
    _write(path, [{"text": "a"}, "[1, 2]"])
    with pytest.raises(DataFileError, match=r"d\.jsonl:2: expected a JSON object, got list"):
        list(JsonlReader(path).records(RecordPosition()))
    with pytest.raises(DataFileError, match=r"cannot read data file .*missing\.jsonl"):
        list(JsonlReader(tmp_path / "missing.jsonl").records(RecordPosition()))


def test_jsonl_resumes_at_a_saved_position_with_the_right_line_numbers(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"text": str(i)} for i in range(5)] + ["", {"text": "5"}])
    records = list(JsonlReader(path).records(RecordPosition()))
    resumed = list(JsonlReader(path).records(records[2].next))
    assert [r.fields for r in resumed] == [r.fields for r in records[3:]]
    assert [r.where for r in resumed] == [r.where for r in records[3:]]
    assert resumed[-1].where.endswith(":7")


def test_packing_gives_full_rows_with_documents_restarting() -> None:
    samples = [TokenRow(input_ids=[n] * n, labels=[n] * n) for n in (3, 4, 2, 5)]
    rows = pack_rows(samples, sequence_length=8, pad_id=0)
    assert [r.input_ids for r in rows] == [[3, 3, 3, 4, 4, 4, 4, 0], [2, 2, 5, 5, 5, 5, 5, 0]]
    assert [r.document_ids for r in rows] == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 2]]
    assert rows[0].labels[-1] == -100
    batch = stack_rows(rows)
    assert batch.document_ids is not None and tuple(batch.input_ids.shape) == (2, 8)


@pytest.mark.parametrize(
    ("policy", "kept", "truncated", "dropped"),
    [
        ("truncate", 4, 1, 0),  # cut to the row length, counted
        ("drop", None, 0, 1),  # left out, counted
    ],
)
def test_overlong_samples_are_truncated_or_dropped_and_counted(
    policy: Any, kept: int | None, truncated: int, dropped: int
) -> None:
    report = DataReport()
    row = fit_length(
        TokenRow(input_ids=[1] * 6, labels=[1] * 6, where="f:9"),
        sequence_length=4,
        overlong=policy,
        report=report,
    )
    assert (None if row is None else len(row)) == kept
    assert (report.truncated, report.dropped) == (truncated, dropped)
    assert "f:9" in report.summary("f")


def test_bucketing_pads_less_and_visits_every_sample_once() -> None:
    import torch

    lengths = [1 + (i * 37) % 50 for i in range(256)]

    def padding(batches: list[list[int]]) -> int:
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    plain = bucketed_batches(
        lengths, global_batch_size=8, window_batches=1, generator=torch.Generator().manual_seed(0)
    )
    bucketed = bucketed_batches(
        lengths, global_batch_size=8, window_batches=8, generator=torch.Generator().manual_seed(0)
    )
    assert sorted(i for b in bucketed for i in b) == list(range(256))
    assert padding(bucketed) < padding(plain) / 3


def test_padding_collator_pads_right_to_a_multiple() -> None:
    rows = [TokenRow(input_ids=[5, 6, 7], labels=[-100, 6, 7]), TokenRow(input_ids=[8], labels=[8])]
    batch = PaddingCollator(pad_id=0, multiple_of=4)(rows)
    assert batch.input_ids.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch.labels.tolist() == [[-100, 6, 7, -100], [8, -100, -100, -100]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def _stream(path: Path, *, dp_rank: int, dp_size: int, packing: bool) -> StreamingBatchSource[RowBatch]:
    encoder = WordEncoder()
    return StreamingBatchSource(
        reader=JsonlReader(path),
        encode=encoder.encode,
        collator=stack_rows if packing else PaddingCollator(pad_id=0),
        sequence_length=12,
        overlong="truncate",
        packing=packing,
        pad_id=0,
        global_batch_size=4,
        dp_rank=dp_rank,
        dp_size=dp_size,
        report=DataReport(),
        log=lambda _: None,
    )


@pytest.mark.parametrize("packing", [True, False])
def test_streaming_resumes_at_the_exact_sample_and_shards_over_ranks(tmp_path: Path, packing: bool) -> None:
    path = _write(tmp_path / "d.jsonl", _texts(40))

    def unpadded(rows: list[list[int]]) -> list[list[int]]:
        return [[t for t in row if t != 0] for row in rows]

    whole = _stream(path, dp_rank=0, dp_size=1, packing=packing)
    reference = [unpadded(whole.next_batch().input_ids.tolist()) for _ in range(12)]  # more than one pass
    ranks = [_stream(path, dp_rank=r, dp_size=2, packing=packing) for r in range(2)]
    for step in range(5):  # rank 0 takes the first half of each global batch, rank 1 the second
        halves = [unpadded(ranks[r].next_batch().input_ids.tolist()) for r in range(2)]
        assert halves[0] + halves[1] == reference[step]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()  # one position that every rank agrees on
    resumed = _stream(path, dp_rank=0, dp_size=1, packing=packing)
    resumed.load_state_dict(state)
    assert [unpadded(resumed.next_batch().input_ids.tolist()) for _ in range(7)] == reference[5:]


def test_streaming_has_no_epoch_length(tmp_path: Path) -> None:
    source = _stream(_write(tmp_path / "d.jsonl", _texts(4)), dp_rank=0, dp_size=1, packing=True)
    with pytest.raises(ValueError, match=r"set trainer\.max_steps"):
        _ = source.steps_per_epoch


def _build(config: dict[str, Any], tmp_path: Path) -> tuple[TokenDataProvider[RowBatch], Any]:
    provider = TokenDataProvider(
        config=TokenDataConfig.model_validate(config),
        order=DataConfig(),
        encoder_factory=lambda _: WordEncoder(),
        convert=lambda b: b,
    )
    dist = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        context = DataProviderContext(
            dist_context=dist, global_batch_size=4, local_batch_size=4, dp_rank=0, dp_size=1
        )
        return provider, provider.build(context)
    finally:
        dist.close()


def test_provider_packs_or_buckets_and_holds_out(tmp_path: Path) -> None:
    path = str(_write(tmp_path / "d.jsonl", _texts(64)))
    provider, packed = _build({"source": path, "sequence_length": 16, "eval_fraction": 0.25}, tmp_path)
    assert tuple(packed.next_batch().input_ids.shape) == (4, 16)
    assert provider.held_out and provider.report.samples == 64
    _, unpacked = _build({"source": path, "sequence_length": 16, "packing": False}, tmp_path)
    assert unpacked.next_batch().input_ids.shape[1] % 8 == 0


def test_provider_errors_or_skips_bad_samples_and_refuses_an_empty_file(tmp_path: Path) -> None:
    path = str(_write(tmp_path / "d.jsonl", [*_texts(40), {"txt": "typo"}]))
    with pytest.raises(SampleError, match=r"d\.jsonl:41: missing field 'text'"):
        _build({"source": path, "sequence_length": 16}, tmp_path)
    provider, _ = _build({"source": path, "sequence_length": 16, "bad_samples": "skip"}, tmp_path)
    assert provider.report.skipped == 1 and "d.jsonl:41" in provider.report.examples[0]
    empty = str(_write(tmp_path / "empty.jsonl", []))
    with pytest.raises(DataFileError, match=r"empty\.jsonl: no usable samples"):
        _build({"source": empty, "sequence_length": 16}, tmp_path)


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("data/chat.jsonl", "jsonl"),  # a bare path picks the reader by suffix
        ("data/rows.parquet", "parquet"),
        ({"kind": "hf_datasets", "path": "json", "data_files": ["a.jsonl"]}, "hf_datasets"),
    ],
)
def test_source_config_accepts_paths_and_kinds(source: Any, kind: str) -> None:
    config = TokenDataConfig.model_validate({"source": source, "sequence_length": 8})
    assert config.source.kind == kind


def test_source_config_refuses_an_unknown_suffix() -> None:
    with pytest.raises(ValidationError, match=r"\.jsonl or \.parquet"):
        TypeAdapter(TokenDataConfig).validate_python({"source": "data.csv", "sequence_length": 8})
