"""Streaming data says what it does: bad lines as data errors, unlearnable samples dropped, no shuffle."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from loop_toy_job import ToyDataset, ToyProvider, ToyTask, collate, toy_config

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    DataConfig,
    DataError,
    DataProviderContext,
    TrainingConfigurator,
)
from d9d.loop.data import (
    DataFileError,
    DataReport,
    JsonlReader,
    Record,
    RowBatch,
    SampleError,
    StreamingBatchSource,
    TokenDataConfig,
    TokenDataProvider,
    TokenRow,
    fit_length,
    stack_rows,
)
from d9d.mesh import DistributedContext, MeshParameters


class PromptEncoder:
    """``prompt`` words are not learned, ``answer`` words are; each word's id is its length."""

    pad_id = 0

    def encode(self, record: Record) -> TokenRow:
        prompt = [len(w) for w in str(record.fields["prompt"]).split()]
        answer = [len(w) for w in str(record.fields["answer"]).split()]
        return TokenRow(input_ids=prompt + answer, labels=[-100] * len(prompt) + answer, where=record.where)


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _stream(path: Path, report: DataReport, logged: list[str]) -> StreamingBatchSource[RowBatch]:
    return StreamingBatchSource(
        reader=JsonlReader(path),
        encode=PromptEncoder().encode,
        collator=stack_rows,
        sequence_length=4,
        overlong="truncate",
        packing=True,
        pad_id=0,
        global_batch_size=1,
        dp_rank=0,
        dp_size=1,
        report=report,
        log=logged.append,
    )


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_a_prompt_longer_than_a_row_is_dropped_and_counted(policy: Any) -> None:
    report = DataReport()
    row = TokenRow(input_ids=[1] * 6 + [2], labels=[-100] * 6 + [2], where="f.jsonl:3")

    assert fit_length(row, sequence_length=4, overlong=policy, report=report) is None
    assert (report.samples, report.truncated, report.dropped) == (0, 0, 1)
    assert "f.jsonl:3: 7 tokens, none to learn in the first 4" in report.summary("f.jsonl")


def test_the_map_style_reader_drops_it_too(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "d.jsonl", [{"prompt": "a b c d e", "answer": "x"}, {"prompt": "a", "answer": "x y"}]
    )
    provider = TokenDataProvider(
        config=TokenDataConfig.model_validate({"source": str(path), "sequence_length": 4}),
        order=DataConfig(),
        encoder_factory=lambda _: PromptEncoder(),
        convert=lambda b: b,
    )
    dist = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        provider.build(
            DataProviderContext(
                dist_context=dist, global_batch_size=1, local_batch_size=1, dp_rank=0, dp_size=1
            )
        )
    finally:
        dist.close()
    assert (provider.report.samples, provider.report.dropped) == (1, 1)


def test_streaming_logs_the_first_dropped_sample_when_met_and_counts_after_the_pass(tmp_path: Path) -> None:
    lines = [
        {"prompt": "a", "answer": "x y"},
        {"prompt": "a b c d e", "answer": "x"},
        {"prompt": "a", "answer": "x"},
    ]
    report, logged = DataReport(), list[str]()
    source = _stream(_write(tmp_path / "d.jsonl", lines), report, logged)

    source.next_batch()  # the first row closes when the long sample is met: it is logged there
    assert any("d.jsonl:2: 6 tokens, none to learn" in line for line in logged)
    source.next_batch()
    source.next_batch()
    assert any("2 samples used, 0 truncated, 1 dropped" in line for line in logged)


def test_a_bad_line_mid_stream_is_the_same_data_error_as_at_load(tmp_path: Path) -> None:
    lines = [{"prompt": "a", "answer": "x"}] * 3 + ["{oops"]
    source = _stream(_write(tmp_path / "d.jsonl", lines), DataReport(), [])
    source.next_batch()  # the first row is read before the bad line

    def take_the_rest() -> None:
        for _ in range(4):
            source.next_batch()

    with pytest.raises(DataFileError, match=r"^.*d\.jsonl:4: not valid JSON"):
        take_the_rest()
    assert issubclass(DataFileError, DataError) and issubclass(SampleError, DataError)


class _BadAtSample(ToyDataset):
    def __getitem__(self, index: int) -> Any:
        if index >= 40:
            raise DataFileError(f"d.jsonl:{index + 1}: not valid JSON")
        return super().__getitem__(index)


def test_the_trainer_lets_a_data_error_through_unwrapped() -> None:
    # a data error at step 2 once surfaced as "StepFailedError: step 2 failed on rank 0: ..."
    config = toy_config(trainer={"max_steps": 20}, data={"shuffle": False})
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=ToyProvider("hsdp", 16),
        task_provider=lambda ctx: ToyTask(False),
        data_provider=AutoDataProvider(
            dataset_factory=lambda d: _BadAtSample(), collator=collate, config=config.data
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
    ).configure()
    with trainer, pytest.raises(DataFileError, match=r"^d\.jsonl:\d+: not valid JSON$"):
        trainer.train()


def test_streaming_warns_that_shuffle_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "x"}])
    provider = TokenDataProvider(
        config=TokenDataConfig.model_validate({"source": str(path), "sequence_length": 4, "streaming": True}),
        order=DataConfig(shuffle=True),
        encoder_factory=lambda _: PromptEncoder(),
        convert=lambda b: b,
    )
    dist = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        with caplog.at_level(logging.INFO):
            provider.build(
                DataProviderContext(
                    dist_context=dist, global_batch_size=1, local_batch_size=1, dp_rank=0, dp_size=1
                )
            )
    finally:
        dist.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("data.shuffle is ignored" in w for w in warnings), caplog.text
