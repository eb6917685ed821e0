"""What a decoder model takes: the batch on the first stage, a hand-off dict on the others."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d9d.kernels.layers import document_ids_from_position_ids, position_ids_from_document_ids

StageHandoff = dict[str, torch.Tensor]
"""What a non-last pipeline stage returns and the next one takes.

Keys: ``hidden_states`` (batch, seq, hidden) and ``position_ids`` always; ``document_ids``
(when the batch had them or an ``attention_mask``: pads become documents of their own),
``labels`` (``summed_loss_labels`` with ``DecoderInputs.summed_losses``) and ``attention_mask``
when the batch had them; ``load_balancing_statistics`` ``(batch, 2 * experts + 1)``
on MoE models whose objective has the load-balancing loss (``DecoderSpec.load_balancing``).
A plain dict of tensors, so any pipeline transport and microbatch split can carry it.
"""


SUMMED_LABELS_KEY = "summed_loss_labels"
"""The hand-off key of the labels when ``DecoderInputs.summed_losses`` (the flag travels as the key)."""


def handoff_labels(handoff: StageHandoff) -> tuple[torch.Tensor | None, bool]:
    """The hand-off's causal-LM labels and whether the caller sums their losses with one weight."""
    summed = handoff.get(SUMMED_LABELS_KEY)
    if summed is not None:
        return summed, True
    return handoff.get("labels"), False


@dataclass(kw_only=True)
class DecoderInputs:
    """One batch (or microbatch) for a decoder model of any family; every tensor is ``(batch, seq)``.

    Attributes:
        input_ids: Token ids.
        labels: Causal-LM targets already aligned with the positions (``labels[:, t]`` is the token
            that should follow position ``t``; see ``causal_lm_targets``), ``-100`` where no loss is
            wanted. Read only by the causal-LM head.
        document_ids: Ids of packed documents; attention stays within a document. Derived from
            ``position_ids`` when only those are given.
        position_ids: Rotary positions; derived from ``document_ids`` (restarting per document)
            or ``0..seq-1`` when absent.
        attention_mask: Nonzero on real tokens, zero on padding. Attention skips padding (each
            pad token attends only to itself), so left- and right-padded rows give the real
            tokens the same outputs as unpadded ones; positions stay ``0..seq-1`` (or those
            given), as transformers numbers them. Padding sits at the ends of a row (left, right
            or both); padding between real tokens is refused where the batch is built, on the
            host (``check_padding_at_row_ends``: ``MultiHeadBatch.collate`` and the whole-model
            helpers call it), never in the forward, which would wait for the device to read the
            mask back. With packed documents the document mask still applies. Pooling heads use
            it to skip padding too (the classification head otherwise derives a pooling mask
            from ``pad_token_id``, which only picks the pooled token, as in transformers).
        one_document_per_row: Each row is one document even though ``position_ids`` are given
            without ``document_ids`` (a context-parallel rank's part of a row: its positions
            jump between its two chunks); no document ids are derived, so attention needs no
            document mask.
        summed_losses: The caller reduces the per-token losses with one weight for every target
            token (a sum, or a mean over the targets, as ``CausalLMTask`` does): the language-model
            head then computes its gradients in the forward instead of recomputing the logits in
            the backward. Leave False when tokens weigh differently (e.g. GRPO's advantages):
            the head's weight gradient would be wrong.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    one_document_per_row: bool = False
    summed_losses: bool = False

    def handoff(self, hidden_states: torch.Tensor, *, padding_mask: torch.Tensor | None) -> StageHandoff:
        """The hand-off dict of this batch with ``hidden_states``, positions resolved.

        Args:
            hidden_states: The embedded tokens.
            padding_mask: The caller's ``attention_mask`` (nonzero on real tokens), which
                attention honours through the hand-off's ``document_ids`` (``padded_document_ids``);
                None attends to every token.
        """
        if self.one_document_per_row and self.position_ids is not None:
            document_ids, position_ids = None, self.position_ids
        else:
            document_ids, position_ids = resolve_positions(
                self.input_ids, self.document_ids, self.position_ids
            )
        if padding_mask is not None:
            document_ids = padded_document_ids(padding_mask, document_ids, self.input_ids.shape)
        out: StageHandoff = {"hidden_states": hidden_states, "position_ids": position_ids}
        if document_ids is not None:
            out["document_ids"] = document_ids
        if self.labels is not None:
            out[SUMMED_LABELS_KEY if self.summed_losses else "labels"] = self.labels
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        return out


def check_padding_at_row_ends(attention_mask: torch.Tensor) -> None:
    """Refuses a mask with padding between real tokens of a row (a row like ``1 0 1``).

    Reads the mask's values: call it on the host, where the batch is built (on an accelerator's
    tensor it waits for the device). Attention sees pads as documents of their own
    (``padded_document_ids``), and FlashAttention's varlen kernels read documents as runs of
    equal ids, so a row's real tokens must be one run.

    Args:
        attention_mask: ``(batch, seq)``, nonzero on real tokens.

    Raises:
        ValueError: Naming the first row with padding between real tokens.
    """
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be (batch, seq), got shape {tuple(attention_mask.shape)}")
    real = attention_mask != 0
    run_starts = real.clone()
    run_starts[:, 1:] &= ~real[:, :-1]
    split = (run_starts.sum(dim=1) > 1).nonzero().flatten()
    if split.numel() > 0:
        raise ValueError(
            f"attention_mask row {int(split[0])} has padding between real tokens; pad only on the "
            "left or the right of a row"
        )


def padded_document_ids(
    attention_mask: torch.Tensor, document_ids: torch.Tensor | None, shape: tuple[int, ...] | torch.Size
) -> torch.Tensor:
    """Document ids under which attention skips padding: every pad token is a document of its own.

    Real tokens keep their document (one per row without packing), each pad token gets an id no
    real token has (``int64`` minimum plus its column), so a real token never attends to a pad
    and a pad attends only to itself. Every attention backend honours document ids, FlashAttention's
    varlen kernels as runs of equal ids: that is why padding must sit at the row's ends, where the
    real tokens stay one run. Only queues device work (no value is read back): the mask's values
    are checked on the host where the batch is built (``check_padding_at_row_ends``).

    Args:
        attention_mask: ``(batch, seq)``, nonzero on real tokens.
        document_ids: ``(batch, seq)`` packed-document ids, or None for one document per row.
        shape: ``input_ids``' shape, which the mask must have.

    Returns:
        ``(batch, seq)`` int64 document ids.

    Raises:
        ValueError: If the mask's shape differs from ``shape``.
    """
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(shape)}")
    real = attention_mask != 0
    batch, seq = real.shape
    columns = torch.arange(seq, device=real.device, dtype=torch.int64).expand(batch, seq)
    pads = columns + torch.iinfo(torch.int64).min
    documents = torch.zeros_like(columns) if document_ids is None else document_ids.to(torch.int64)
    return torch.where(real, documents, pads)


def resolve_positions(
    input_ids: torch.Tensor, document_ids: torch.Tensor | None, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(document_ids, position_ids)`` completed from whichever of the two was given.

    Decided from which tensors are given, never from their values, so that it runs on the meta
    device (the pipeline's shape pass) and yields the same keys there as on real data: positions
    given without document ids always give document ids (Hugging Face packing), neither gives
    ``0..seq-1`` and no document ids.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if position_ids is None:
        if document_ids is None:
            batch, seq = input_ids.shape
            position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        else:
            position_ids = position_ids_from_document_ids(document_ids)
    elif document_ids is None:
        document_ids = document_ids_from_position_ids(position_ids)
    return document_ids, position_ids


def causal_lm_targets(
    labels: torch.Tensor, *, document_ids: torch.Tensor | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """Shifts Hugging Face style labels (``labels[:, t]`` is token ``t``) into per-position targets.

    Position ``t`` predicts ``labels[:, t + 1]``; the last position of a row, and with packed
    documents the last position of every document, get ``ignore_index``.

    Args:
        labels: ``(batch, seq)`` token ids, ``ignore_index`` where no loss is wanted.
        document_ids: ``(batch, seq)`` ids of packed documents.
        ignore_index: The label that contributes no loss.

    Returns:
        ``(batch, seq)`` targets for ``DecoderInputs.labels``.
    """
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    if document_ids is not None:
        crosses = document_ids[:, 1:] != document_ids[:, :-1]
        targets[:, :-1] = targets[:, :-1].masked_fill(crosses, ignore_index)
    return targets
