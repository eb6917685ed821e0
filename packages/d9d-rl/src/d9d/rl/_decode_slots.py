"""The host's view of the static decode step: which buffer row each decoding sequence uses.

A decoding sequence keeps its row of the device buffers (and so its device block table) from step
to step; only its new token, its length and the blocks it took since the last step are sent. A
step runs a batch-size bucket (a power of two, or ``max_rows``) of rows; a sequence whose row lies
past the bucket of the current count moves to a free row inside it (its whole table sent again),
so the bucket shrinks as rows finish. A sequence whose new token is still on the device (the
previous step's, not yet read on the host) names its place in that step's tokens instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from d9d.rl._decode_step import DecodeUpdate
from d9d.rl._scheduler import PENDING_TOKEN, SequenceState


def bucket_for(count: int, max_rows: int) -> int:
    """The smallest power of two at least ``count``, capped at ``max_rows``."""
    return min(1 << max(count - 1, 0).bit_length(), max_rows)


def buckets(max_rows: int) -> list[int]:
    """Every bucket a step of at most ``max_rows`` rows may run, largest first."""
    return sorted({bucket_for(count, max_rows) for count in range(1, max_rows + 1)}, reverse=True)


class DecodeSlots:
    """Rows of the device buffers owned by the decoding sequences, and the blocks sent for each.

    Args:
        max_rows: Rows of the device buffers.
        pad_token_id: The input token of an idle row.
    """

    def __init__(self, max_rows: int, *, pad_token_id: int) -> None:
        self.max_rows = max_rows
        self._pad = pad_token_id
        self._row_of: dict[int, int] = {}
        self._sent = [0] * max_rows

    def plan(self, sequences: Sequence[SequenceState], fed: Mapping[int, int] | None = None) -> DecodeUpdate:
        """The update that makes the buffers hold ``sequences`` (one new token each) for this step.

        Sequences not in ``sequences`` (finished, preempted, being prefilled) give their rows back.

        Args:
            sequences: The decoding sequences.
            fed: For a sequence (by ``index``) whose new token is a ``PENDING_TOKEN``, its place in
                the device tokens the step is fed (``DecodeUpdate.sources``).

        Returns:
            The update; its ``order`` is the buffer row of each sequence.

        Raises:
            RuntimeError: If a sequence's new token is pending and ``fed`` does not name it.
        """
        rows = bucket_for(len(sequences), self.max_rows)
        keep = {sequence.index for sequence in sequences}
        row_of = {index: row for index, row in self._row_of.items() if index in keep and row < rows}
        taken = set(row_of.values())
        free = (row for row in range(rows) if row not in taken)
        for sequence in sequences:
            if sequence.index not in row_of:
                row = next(free)
                row_of[sequence.index] = row
                self._sent[row] = 0
        self._row_of = row_of
        return self._update(sequences, rows, {} if fed is None else fed)

    def _update(self, sequences: Sequence[SequenceState], rows: int, fed: Mapping[int, int]) -> DecodeUpdate:
        input_ids, lengths, sources = [self._pad] * rows, [0] * rows, [-1] * rows
        table_rows: list[int] = []
        table_columns: list[int] = []
        table_blocks: list[int] = []
        for sequence in sequences:
            row = self._row_of[sequence.index]
            token = sequence.tokens[-1]
            if token == PENDING_TOKEN:
                if sequence.index not in fed:
                    raise RuntimeError(
                        f"row {sequence.index}'s new token is on the device and no step feeds it"
                    )
                sources[row], token = fed[sequence.index], self._pad
            input_ids[row] = token
            lengths[row] = len(sequence.tokens)
            sent = self._sent[row]
            new = sequence.blocks[sent:]
            table_rows += [row] * len(new)
            table_columns += range(sent, sent + len(new))
            table_blocks += new
            self._sent[row] = len(sequence.blocks)
        return DecodeUpdate(
            rows=rows,
            order=[self._row_of[sequence.index] for sequence in sequences],
            input_ids=input_ids,
            lengths=lengths,
            sources=sources if fed else None,
            table_rows=table_rows,
            table_columns=table_columns,
            table_blocks=table_blocks,
        )

    def reset(self) -> None:
        """Forgets every row's owner (a new ``generate`` call)."""
        self._row_of = {}
