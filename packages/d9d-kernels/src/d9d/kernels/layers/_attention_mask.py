"""Boolean attention masks for causal, sliding-window and packed-document attention."""

from __future__ import annotations

import torch


def needs_explicit_mask(*, sliding_window: int | None, document_ids: torch.Tensor | None) -> bool:
    """Whether a mask beyond plain causal/full attention is needed."""
    return sliding_window is not None or document_ids is not None


def check_sliding_window(sliding_window: int | None) -> None:
    """Raises unless ``sliding_window`` is None or positive (a window always holds the query)."""
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive")


def check_document_ids(document_ids: torch.Tensor, seq: int, batch: int | None = None) -> None:
    """Raises unless ``document_ids`` is ``(batch, seq)`` (any batch when ``batch`` is None)."""
    if document_ids.ndim != 2 or document_ids.shape[1] != seq or batch not in (None, document_ids.shape[0]):
        expected = f"({'batch' if batch is None else batch}, {seq})"
        raise ValueError(f"document_ids must be {expected}, got shape {tuple(document_ids.shape)}")


def build_attention_mask(
    seq: int,
    *,
    causal: bool,
    sliding_window: int | None = None,
    document_ids: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Builds the boolean mask of allowed (query, key) pairs; True means attend.

    The mask is the one ``AttentionBackend`` defines: ``causal`` allows ``j <= i``,
    ``sliding_window=w`` allows ``|i - j| < w``, ``document_ids`` allows equal ids.

    Args:
        seq: Sequence length (queries and keys).
        causal: Keys after the query are masked.
        sliding_window: ``w``: keys with ``|query - key| >= w`` are masked.
        document_ids: ``(batch, seq)``; keys of another document are masked.
        device: Where to build the mask (defaults to ``document_ids``' device).

    Returns:
        ``(batch or 1, 1, seq, seq)`` bool mask, broadcastable over heads.
    """
    check_sliding_window(sliding_window)
    if document_ids is not None:
        device = document_ids.device
        check_document_ids(document_ids, seq)
    query_index = torch.arange(seq, device=device)[:, None]
    key_index = torch.arange(seq, device=device)[None, :]
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=device)
    if causal:
        allowed &= key_index <= query_index
    if sliding_window is not None:
        allowed &= (query_index - key_index).abs() < sliding_window
    mask = allowed[None, None]
    if document_ids is not None:
        same_document = document_ids[:, :, None] == document_ids[:, None, :]
        mask = mask & same_document[:, None]
    return mask
