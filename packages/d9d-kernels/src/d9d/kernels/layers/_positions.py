"""Positions and document ids of packed sequences (several documents concatenated in one row)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from d9d.kernels.layers._recent_tensor_memo import RecentTensorMemo


def position_ids_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at the start of every document.

    A document is a run of equal ids within a row; a row always starts a new document.

    Args:
        document_ids: ``(batch, seq)`` integer document ids.

    Returns:
        ``(batch, seq)`` int64 positions within each document.
    """
    return _positions_within_runs(_run_starts(document_ids))


def _run_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``(batch, seq)`` bool: True where a run of equal ids begins (every row's first token)."""
    if document_ids.ndim != 2:
        raise ValueError(f"document_ids must be (batch, seq), got shape {tuple(document_ids.shape)}")
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def _positions_within_runs(starts: torch.Tensor) -> torch.Tensor:
    """Each token's distance from the start of its run, given ``_run_starts``."""
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids of packed rows whose positions restart at every document (Hugging Face packing).

    A new document starts wherever a position is not the previous one plus one.

    Args:
        position_ids: ``(batch, seq)`` integer positions.

    Returns:
        ``(batch, seq)`` int64 document ids counting from 0 in every row.
    """
    if position_ids.ndim != 2:
        raise ValueError(f"position_ids must be (batch, seq), got shape {tuple(position_ids.shape)}")
    starts = torch.zeros_like(position_ids, dtype=torch.int64)
    starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1).to(torch.int64)
    return starts.cumsum(dim=1)


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Document ids of one packed row given cumulative sequence lengths (FlashAttention's varlen form).

    Args:
        cu_seqlens: ``(num_documents + 1,)`` starting at 0 and ending at the row's length.

    Returns:
        ``(1, total)`` int64 document ids.
    """
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-d with at least 2 entries, got shape {tuple(cu_seqlens.shape)}"
        )
    total = int(cu_seqlens[-1].item())
    tokens = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), tokens, right=True).unsqueeze(0)


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative lengths of the documents of a batch flattened to one row, and the longest one.

    Each run of equal ids within a row is one document; rows never share a document.

    Args:
        document_ids: ``(batch, seq)`` integer document ids.

    Returns:
        ``(cu_seqlens, max_seqlen)``: int32 ``(num_documents + 1,)`` offsets into the flattened
        ``batch * seq`` tokens, and the longest document's length. The document count, the
        longest length and the layout check below come to the host together: one sync.

    Raises:
        ValueError: If an id comes back within a row after another one (``[0, 0, 1, 0]``): mask
            attention (eager, SDPA) would join those runs into one document and a varlen kernel
            would not, so the row is refused, naming it, rather than attended differently.
    """
    starts = _run_starts(document_ids)
    batch, seq = document_ids.shape
    longest = _positions_within_runs(starts).max() + 1
    ordered = document_ids.sort(dim=1).values
    distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(dim=1) + 1
    runs = starts.sum(dim=1)
    rows = torch.arange(batch, device=document_ids.device)
    first_split_row = torch.where(runs != distinct, rows, batch).min()
    count, max_seqlen, split_row = cast(
        list[int], torch.stack([runs.sum(), longest, first_split_row]).tolist()
    )
    if split_row < batch:
        raise ValueError(
            _split_document_message(split_row, cast(list[int], document_ids[split_row].tolist()))
        )
    start_offsets = torch.nonzero_static(starts.reshape(-1), size=count).reshape(-1)
    end = torch.tensor([batch * seq], device=document_ids.device, dtype=start_offsets.dtype)
    return torch.cat([start_offsets, end]).to(torch.int32), max_seqlen


def _split_document_message(row: int, ids: list[int]) -> str:
    """Names the first id of ``ids`` that comes back after another id, and where."""
    closed: set[int] = set()
    for token in range(1, len(ids)):
        if ids[token] != ids[token - 1]:
            closed.add(ids[token - 1])
            if ids[token] in closed:
                return (
                    f"document_ids row {row}: document {ids[token]} comes back at token {token} after "
                    "another document; a packed row holds each document in one contiguous run (mask "
                    "attention would join the runs, a varlen kernel would not)"
                )
    raise AssertionError(f"row {row} has no split document")


class DocumentOffsets:
    """``cu_seqlens_from_document_ids`` of the recent ``document_ids`` tensors, kept for the calls after.

    Every attention layer of a forward gets the same ``document_ids`` tensor, so a backend that the
    layers share finds the offsets, and pays their host sync, once per tensor instead of once per
    layer. The last 8 distinct tensors keep theirs (``RecentTensorMemo``), so a pipeline
    schedule's backward recompute or an interleaved gradient-accumulation microbatch finds them
    again; an in-place change, or a tensor not among them, finds them anew.
    """

    def __init__(self) -> None:
        # a cache lookup runs outside any compiled graph, as FlexAttention's block masks do
        self._lookup = cast(
            Callable[[torch.Tensor], tuple[torch.Tensor, int]],
            torch.compiler.disable(RecentTensorMemo(cu_seqlens_from_document_ids)),
        )

    def __call__(self, document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``cu_seqlens_from_document_ids(document_ids)``, reused while the tensor is recent and unchanged."""
        return self._lookup(document_ids)
