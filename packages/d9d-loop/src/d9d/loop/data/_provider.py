"""The data provider of token jobs: source, encoding, packing or padding, per-rank batches."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from d9d.loop._providers import BatchSource, DataError, DataProviderContext
from d9d.loop.config._data import DataConfig
from d9d.loop.data._auto_data import ShardedBatchSource
from d9d.loop.data._bucketed_source import BucketedBatchSource
from d9d.loop.data._config import TokenDataConfig
from d9d.loop.data._packing import fit_length, pack_rows
from d9d.loop.data._records import DataFileError, Record, RecordPosition, RecordReader
from d9d.loop.data._report import DataReport
from d9d.loop.data._rows import PaddingCollator, RowBatch, TokenRow, stack_rows
from d9d.loop.data._source_config import open_source
from d9d.loop.data._streaming_source import StreamingBatchSource
from d9d.mesh import DistributedContext

BatchT = TypeVar("BatchT")


class SampleError(DataError):
    """A record cannot become a sample (a missing field, a template that fails); names the record."""


class SampleEncoder(Protocol):
    """Turns one record into a row of tokens (the tokenizer-bound part, e.g. d9d-hf's chat encoder)."""

    @property
    def pad_id(self) -> int:
        """Token id of padding."""
        ...

    def encode(self, record: Record) -> TokenRow:
        """The record's tokens and labels.

        Raises:
            SampleError: If the record cannot be used, naming ``record.where``.
        """
        ...


class TokenDataProvider(Generic[BatchT]):
    """Builds each rank's batches from a ``TokenDataConfig`` and a ``SampleEncoder``.

    Not streaming, every rank reads and encodes the source once at build (samples in file
    order; the held-out share is a seeded sample), then packs the rest into rows sharded by
    ``ShardedBatchSource``, or batches unpacked rows by length bucket. Streaming, see
    ``StreamingBatchSource``. What was truncated, dropped or skipped is counted and logged.

    Attributes:
        report: What was used, truncated, dropped and skipped (filled by ``build``).
        source_name: The source as named in messages (set by ``build``).
        held_out: The ``eval_fraction`` share, as rows (packed when ``packing``), after ``build``.

    Args:
        config: The ``dataset`` section.
        order: The job's ``data`` section (order, seed, loader workers).
        encoder_factory: Builds the encoder on each rank (after the model, so its tokenizer is
            known).
        convert: Turns a ``RowBatch`` into the task's batch type.
    """

    def __init__(
        self,
        *,
        config: TokenDataConfig,
        order: DataConfig,
        encoder_factory: Callable[[DistributedContext], SampleEncoder],
        convert: Callable[[RowBatch], BatchT],
    ) -> None:
        self._config = config
        self._order = order
        self._encoder_factory = encoder_factory
        self._convert = convert
        self.report = DataReport()
        self.source_name = ""
        self.held_out: list[TokenRow] = []
        self._encoder: SampleEncoder | None = None

    @property
    def sequence_length(self) -> int:
        """Tokens per row (``dataset.sequence_length``); the memory estimate reads it."""
        return self._config.sequence_length

    def encoder(self, dist_context: DistributedContext) -> SampleEncoder:
        """The encoder (built once)."""
        if self._encoder is None:
            self._encoder = self._encoder_factory(dist_context)
        return self._encoder

    def collate(self, rows: list[TokenRow]) -> BatchT:
        """Rows to the task's batch: stacked when packed, else padded (held-out rows, say)."""
        if self._config.packing:
            return self._convert(stack_rows(rows))
        pad_id = 0 if self._encoder is None else self._encoder.pad_id
        return self._convert(
            PaddingCollator(pad_id=pad_id, multiple_of=self._config.pad_to_multiple_of)(rows)
        )

    def build(self, context: DataProviderContext) -> BatchSource[BatchT]:
        """Opens the source and builds this rank's batches: streamed, or read into memory first."""
        encoder = self.encoder(context.dist_context)
        reader = open_source(self._config.source)
        self.source_name = reader.name
        logger = context.dist_context.logger

        def log(text: str) -> None:
            logger.info(text)

        encode = self._encode_fn(encoder)
        if self._config.streaming:
            if self._order.shuffle:
                logger.warning(
                    "%s: streaming reads the source in file order: data.shuffle is ignored "
                    "(it applies to data read into memory, streaming: false)",
                    reader.name,
                )
            return self._streamed(context, reader, encode, encoder.pad_id, log)
        samples = self._read_all(reader, encode)
        log(self.report.summary(reader.name))
        train = self._split(samples)
        if self._config.packing:
            return self._packed(context, reader.name, train, encoder.pad_id)
        return self._bucketed(context, reader.name, train)

    def _streamed(
        self,
        context: DataProviderContext,
        reader: RecordReader,
        encode: Callable[[Record], TokenRow | None],
        pad_id: int,
        log: Callable[[str], None],
    ) -> BatchSource[BatchT]:
        """Batches encoded as the source is read (counts are logged as they are met)."""
        config = self._config
        log(
            f"{reader.name}: streaming, samples are counted as they are read: the first truncated, "
            "dropped or skipped one is logged when met, the counts after each pass over the source"
        )
        return StreamingBatchSource(
            reader=reader,
            encode=encode,
            collator=self.collate,
            sequence_length=config.sequence_length,
            overlong=config.overlong,
            packing=config.packing,
            pad_id=pad_id,
            global_batch_size=context.global_batch_size,
            dp_rank=context.dp_rank,
            dp_size=context.dp_size,
            report=self.report,
            log=log,
        )

    def _packed(
        self, context: DataProviderContext, name: str, train: list[TokenRow], pad_id: int
    ) -> BatchSource[BatchT]:
        """The samples packed into rows (the held-out share too), sharded over the ranks."""
        length = self._config.sequence_length
        rows = pack_rows(train, sequence_length=length, pad_id=pad_id)
        self.held_out = pack_rows(self.held_out, sequence_length=length, pad_id=pad_id)
        return ShardedBatchSource(
            dataset=_Rows(rows),
            collator=self.collate,
            config=self._order,
            global_batch_size=context.global_batch_size,
            dp_rank=context.dp_rank,
            dp_size=context.dp_size,
            source=f"{name} ({len(rows)} rows)",
        )

    def _bucketed(
        self, context: DataProviderContext, name: str, train: list[TokenRow]
    ) -> BatchSource[BatchT]:
        """The samples unpacked, batched by length bucket."""
        return BucketedBatchSource(
            rows=train,
            collator=self.collate,
            global_batch_size=context.global_batch_size,
            dp_rank=context.dp_rank,
            dp_size=context.dp_size,
            window_batches=self._config.bucket_window,
            shuffle=self._order.shuffle,
            seed=self._order.seed,
            source=f"{name} ({len(train)} rows)",
        )

    def _encode_fn(self, encoder: SampleEncoder) -> Callable[[Record], TokenRow | None]:
        skip = self._config.bad_samples == "skip"
        report = self.report

        def encode(record: Record) -> TokenRow | None:
            try:
                return encoder.encode(record)
            except SampleError as e:
                if not skip:
                    raise
                report.skipped += 1
                report.note(str(e))
                return None

        return encode

    def _read_all(self, reader: RecordReader, encode: Callable[[Record], TokenRow | None]) -> list[TokenRow]:
        config = self._config
        samples: list[TokenRow] = []
        for record in reader.records(RecordPosition()):
            encoded = encode(record)
            if encoded is None:
                continue
            fitted = fit_length(
                encoded, sequence_length=config.sequence_length, overlong=config.overlong, report=self.report
            )
            if fitted is not None:
                samples.append(fitted)
        if not samples:
            raise DataFileError(f"{reader.name}: no usable samples ({self.report.summary(reader.name)})")
        return samples

    def _split(self, samples: list[TokenRow]) -> list[TokenRow]:
        fraction = self._config.eval_fraction
        if fraction == 0:
            return samples
        indices = list(range(len(samples)))
        random.Random(self._order.seed).shuffle(indices)
        count = max(1, round(len(samples) * fraction))
        held = set(indices[:count])
        self.held_out = [samples[i] for i in sorted(held)]
        return [s for i, s in enumerate(samples) if i not in held]


class _Rows:
    """A list of rows as a map-style dataset."""

    def __init__(self, rows: list[TokenRow]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> TokenRow:
        return self._rows[index]
