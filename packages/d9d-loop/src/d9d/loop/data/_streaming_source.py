"""Batches read in a stream from a source larger than memory, resumable at the exact sample."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

from d9d.loop.data._packing import SequencePacker, fit_length
from d9d.loop.data._records import DataFileError, Record, RecordPosition, RecordReader
from d9d.loop.data._report import DataReport, OverlongPolicy
from d9d.loop.data._rows import TokenRow

BatchT = TypeVar("BatchT")


@dataclass(kw_only=True, frozen=True)
class _Resume:
    """Where re-reading reproduces every row after the ones already taken."""

    epoch: int
    position: RecordPosition


class StreamingBatchSource(Generic[BatchT]):
    """A ``BatchSource`` that reads, encodes and (optionally) packs records as training goes.

    Every rank reads and encodes the whole stream and keeps its slice of each global batch of
    rows, so the position, the first record not yet in a taken row, is one value that every rank
    agrees on: a checkpoint holds it, and a resume seeks there and rebuilds exactly the rows that
    follow. (The price: with ``dp`` data-parallel ranks the stream is tokenized ``dp`` times; see
    the benchmark in the docs for the rate of one core.) At the end of the source the next
    epoch starts from its beginning, in the same order; the run length comes from
    ``trainer.max_steps``.

    Args:
        reader: The source.
        encode: Turns a record into a sample (None: skipped, which ``encode`` counts).
        collator: Turns this rank's rows into a batch.
        sequence_length: Tokens per row (and the longest sample kept).
        overlong: What happens to longer samples.
        packing: Pack samples into rows of exactly ``sequence_length`` (False: one per row).
        pad_id: Token id of packing's padding.
        global_batch_size: Rows per step over all data-parallel ranks.
        dp_rank: This rank's data shard.
        dp_size: Number of data shards.
        report: Where truncated, dropped and skipped samples are counted.
        log: Called with the report's summary at the end of each pass over the source.
    """

    def __init__(
        self,
        *,
        reader: RecordReader,
        encode: Callable[[Record], TokenRow | None],
        collator: Callable[[list[TokenRow]], BatchT],
        sequence_length: int,
        overlong: OverlongPolicy,
        packing: bool,
        pad_id: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        report: DataReport,
        log: Callable[[str], None],
    ) -> None:
        if global_batch_size % dp_size != 0:
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by data-parallel size {dp_size}"
            )
        self._reader = reader
        self._encode = encode
        self._collator = collator
        self._length = sequence_length
        self._overlong: OverlongPolicy = overlong
        self._packing = packing
        self._pad_id = pad_id
        self._global = global_batch_size
        self._local = global_batch_size // dp_size
        self._offset = dp_rank * self._local
        self._report = report
        self._log = log
        self._resume = _Resume(epoch=0, position=RecordPosition())
        self._stream: Iterator[tuple[TokenRow, _Resume]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        raise ValueError(
            f"streaming data ({self._reader.name}) has no known epoch length: set trainer.max_steps"
        )

    def _pass(self, epoch: int, start: RecordPosition) -> Iterator[tuple[TokenRow, _Resume]]:
        """The rows of one pass from ``start``, each with where to resume after taking it."""
        packer = SequencePacker(sequence_length=self._length, pad_id=self._pad_id) if self._packing else None
        before = start
        any_row = start.index > 0
        for record in self._reader.records(start):
            noted = len(self._report.examples)
            encoded = self._encode(record)
            sample = (
                None
                if encoded is None
                else fit_length(
                    encoded, sequence_length=self._length, overlong=self._overlong, report=self._report
                )
            )
            if noted == 0 and self._report.examples:
                self._log(f"{self._report.examples[0]} (the counts follow after this pass over the source)")
            if sample is not None:
                if packer is None:
                    any_row = True
                    yield sample, _Resume(epoch=epoch, position=record.next)
                elif (closed := packer.add(sample)) is not None:
                    any_row = True
                    yield closed, _Resume(epoch=epoch, position=before)
            before = record.next
        last = None if packer is None else packer.close()
        if last is not None:
            any_row = True
            yield last, _Resume(epoch=epoch + 1, position=RecordPosition())
        self._log(self._report.summary(self._reader.name))
        if not any_row:
            raise DataFileError(
                f"{self._reader.name}: no usable samples ({self._report.summary(self._reader.name)})"
            )

    def _rows(self, resume: _Resume) -> Iterator[tuple[TokenRow, _Resume]]:
        epoch, start = resume.epoch, resume.position
        while True:
            yield from self._pass(epoch, start)
            epoch, start = epoch + 1, RecordPosition()

    def next_batch(self) -> BatchT:
        if self._stream is None:
            self._stream = self._rows(self._resume)
        taken: list[TokenRow] = []
        for i in range(self._global):
            row, self._resume = next(self._stream)
            if self._offset <= i < self._offset + self._local:
                taken.append(row)
        return self._collator(taken)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the record position (index, byte offset, line) the next rows start at.

        ``source`` names the data read, so a resume on another source says so.
        """
        return {
            "epoch": self._resume.epoch,
            "position": asdict(self._resume.position),
            "source": self._reader.name,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues at the saved position (the next batch is the one the saved run would take)."""
        self._resume = _Resume(epoch=int(state["epoch"]), position=RecordPosition(**state["position"]))
        self._stream = None
