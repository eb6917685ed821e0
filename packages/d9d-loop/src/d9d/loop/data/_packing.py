"""Fitting samples to a row length, and packing them into fixed-length rows of several documents."""

from __future__ import annotations

from d9d.loop.data._report import DataReport, OverlongPolicy
from d9d.loop.data._rows import IGNORE_INDEX, TokenRow


def fit_length(
    row: TokenRow, *, sequence_length: int, overlong: OverlongPolicy, report: DataReport
) -> TokenRow | None:
    """``row`` cut to ``sequence_length`` (or None when dropped), counted in ``report``.

    A sample whose first ``sequence_length`` tokens hold no label (a prompt longer than a row)
    is dropped under either policy: cut, it would take a row and teach nothing.
    """
    if len(row) <= sequence_length:
        report.samples += 1
        return row
    if all(label == IGNORE_INDEX for label in row.labels[:sequence_length]):
        report.dropped += 1
        report.note(
            f"{row.where}: {len(row)} tokens, none to learn in the first {sequence_length} "
            "(the prompt fills the row), dropped"
        )
        return None
    match overlong:
        case "truncate":
            report.truncated += 1
            report.samples += 1
            report.note(f"{row.where}: {len(row)} tokens truncated to {sequence_length}")
            return TokenRow(
                input_ids=row.input_ids[:sequence_length],
                labels=row.labels[:sequence_length],
                where=row.where,
            )
        case "drop":
            report.dropped += 1
            report.note(f"{row.where}: {len(row)} tokens > sequence_length {sequence_length}, dropped")
            return None


class SequencePacker:
    """Packs samples greedily, in order, into rows of exactly ``sequence_length`` tokens.

    Each sample is its own document of the row (``document_ids`` count 0, 1, ... within a row),
    so attention and positions restart per sample; the padding at a row's end is one more
    document with no loss. A sample that does not fit in the open row closes it. Samples must
    already fit a row (see ``fit_length``).

    Args:
        sequence_length: Tokens per row.
        pad_id: Token id of padding.
    """

    def __init__(self, *, sequence_length: int, pad_id: int) -> None:
        self._length = sequence_length
        self._pad_id = pad_id
        self._ids: list[int] = []
        self._labels: list[int] = []
        self._documents: list[int] = []
        self._count = 0
        self._where = ""

    @property
    def pending(self) -> bool:
        """Whether the open row holds any sample."""
        return self._count > 0

    def add(self, sample: TokenRow) -> TokenRow | None:
        """Adds ``sample``; returns the row it closed, if it did not fit in the open one."""
        if len(sample) > self._length:
            raise ValueError(f"{sample.where}: {len(sample)} tokens do not fit a row of {self._length}")
        closed = self.close() if len(self._ids) + len(sample) > self._length else None
        if not self._count:
            self._where = sample.where
        self._ids += sample.input_ids
        self._labels += sample.labels
        self._documents += [self._count] * len(sample)
        self._count += 1
        return closed

    def close(self) -> TokenRow | None:
        """The open row padded to length (None when empty); the next sample starts a new row."""
        if not self._count:
            return None
        padding = self._length - len(self._ids)
        row = TokenRow(
            input_ids=self._ids + [self._pad_id] * padding,
            labels=self._labels + [IGNORE_INDEX] * padding,
            document_ids=self._documents + [self._count] * padding,
            where=self._where,
        )
        self._ids, self._labels, self._documents, self._count = [], [], [], 0
        return row


def pack_rows(samples: list[TokenRow], *, sequence_length: int, pad_id: int) -> list[TokenRow]:
    """All of ``samples`` packed into rows (see ``SequencePacker``)."""
    packer = SequencePacker(sequence_length=sequence_length, pad_id=pad_id)
    rows = [row for sample in samples if (row := packer.add(sample)) is not None]
    last = packer.close()
    return rows if last is None else [*rows, last]
