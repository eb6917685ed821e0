"""DPO's data: preference pairs scored once by the frozen reference model, then batched per rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from d9d.hf import DecoderInputs
from d9d.hf.data import PreferenceData, PreferencePair
from d9d.loop import BatchSource, DataConfig, DataProviderContext, ShardedBatchSource
from d9d.mesh import DistributedContext, all_gather_object
from d9d.rl._dpo_batch import DPOBatch, ReferenceScore, collate_pairs, preference_rows


@torch.no_grad()
def score_pairs(
    model: nn.Module, pairs: Sequence[PreferencePair], *, pad_id: int, device: torch.device | str = "cpu"
) -> list[ReferenceScore]:
    """The model's summed log-probability of each pair's two answers (one forward for all pairs).

    Args:
        model: A whole causal LM of d9d-hf (``model(DecoderInputs(input_ids, labels))`` returns
            the per-position cross-entropy, ``-log p`` of each target); it is not changed.
        pairs: The pairs to score.
        pad_id: Padding's token id.
        device: Where the model is.

    Raises:
        TypeError: If the model does not return one ``(rows, seq)`` tensor.
    """
    input_ids, targets = preference_rows(pairs, pad_id=pad_id)
    targets = targets.to(device)
    losses = model(DecoderInputs(input_ids=input_ids.to(device), labels=targets))
    if not isinstance(losses, torch.Tensor) or losses.shape != targets.shape:
        raise TypeError(
            f"the reference model must return per-position losses of shape {tuple(targets.shape)}, "
            f"got {type(losses).__name__}"
        )
    summed = -(losses.double() * (targets != -100)).sum(dim=-1).cpu()
    return [
        ReferenceScore(chosen=float(summed[2 * i]), rejected=float(summed[2 * i + 1]))
        for i in range(len(pairs))
    ]


class DPODataProvider:
    """Preference pairs, with reference scores computed before training, sharded over the ranks.

    At ``build`` (before the first step) the pairs are read and, with ``reference``, the
    reference model is built on every rank; rank ``r`` of ``W`` scores pairs ``r, r + W, ...`` in
    chunks, the scores are gathered on every rank, and the reference model is dropped before
    training starts. Each batch then carries its pairs' scores (``DPOBatch.ref_log_probs``): the
    policy's initial weights as the reference, with no second model in memory while training.
    That reference is a whole model on each rank (no sharding), so it must fit one device.
    Without ``reference`` the batches carry no scores, for a colocated reference
    (``DPOTask(reference=ReferenceModel(...))``, laid out like the policy).

    ``trainer.global_batch_size`` and ``trainer.microbatch_size`` count pairs (two rows each).

    Args:
        pairs: Reads the pairs on each rank (``load_preference_pairs`` with the tokenizer of the
            checkpoint, say).
        reference: Builds the frozen reference model on each rank (``load_pretrained`` of the
            policy's checkpoint, on ``dist_context.device``); None scores nothing here.
        order: The job's ``data`` section (order, seed, loader workers).
        pairs_per_forward: Pairs scored per reference forward.
    """

    def __init__(
        self,
        *,
        pairs: Callable[[DistributedContext], PreferenceData],
        reference: Callable[[DistributedContext], nn.Module] | None,
        order: DataConfig,
        pairs_per_forward: int = 8,
    ) -> None:
        if pairs_per_forward < 1:
            raise ValueError(f"pairs_per_forward must be at least 1, got {pairs_per_forward}")
        self._pairs = pairs
        self._reference = reference
        self._order = order
        self._chunk = pairs_per_forward

    def build(self, context: DataProviderContext) -> BatchSource[DPOBatch]:
        """Reads and scores the pairs, then returns this rank's batches."""
        dist_context = context.dist_context
        data = self._pairs(dist_context)
        dist_context.logger.info(data.report.summary(data.source))
        scores = None if self._reference is None else self._score(dist_context, data, self._reference)
        dataset = _ScoredPairs(data.pairs, scores)
        pad_id = data.pad_id

        def collate(items: list[tuple[PreferencePair, ReferenceScore | None]]) -> DPOBatch:
            found = [s for _, s in items if s is not None]
            return collate_pairs([p for p, _ in items], found if scores is not None else None, pad_id=pad_id)

        return ShardedBatchSource(
            dataset=dataset,
            collator=collate,
            config=self._order,
            global_batch_size=context.global_batch_size,
            dp_rank=context.dp_rank,
            dp_size=context.dp_size,
            source=f"{data.source} ({len(data.pairs)} pairs)",
        )

    def _score(
        self,
        dist_context: DistributedContext,
        data: PreferenceData,
        reference: Callable[[DistributedContext], nn.Module],
    ) -> list[ReferenceScore]:
        rank, world = dist_context.rank, dist_context.world_size
        mine = data.pairs[rank::world]
        model = reference(dist_context)
        model.eval()
        local: list[ReferenceScore] = []
        for start in range(0, len(mine), self._chunk):
            chunk = mine[start : start + self._chunk]
            local.extend(score_pairs(model, chunk, pad_id=data.pad_id, device=dist_context.device))
        del model
        gathered = [local] if world == 1 else all_gather_object(local, dist_context.world_group())
        scores: list[ReferenceScore | None] = [None] * len(data.pairs)
        for r, part in enumerate(gathered):
            scores[r::world] = part
        return [s for s in scores if s is not None]


class _ScoredPairs:
    """Pairs with their reference scores (when scored) as a map-style dataset."""

    def __init__(self, pairs: list[PreferencePair], scores: list[ReferenceScore] | None) -> None:
        if scores is not None and len(pairs) != len(scores):
            raise ValueError(f"{len(pairs)} pairs but {len(scores)} reference scores")
        self._pairs = pairs
        self._scores = scores

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, index: int) -> tuple[PreferencePair, ReferenceScore | None]:
        return self._pairs[index], None if self._scores is None else self._scores[index]
