"""How many parameter elements one pipeline rank holds, frozen and trained, after sharding."""

from __future__ import annotations

import re
from dataclasses import dataclass

from d9d.loop.estimate._job import MemoryJob
from d9d.loop.estimate._shape import LinearShape


@dataclass(kw_only=True, frozen=True)
class RankParameters:
    """One rank's parameter elements.

    Attributes:
        frozen: Elements of this rank's shards that are not trained.
        quantizable: Of ``frozen``, the base weights of LoRA-adapted linears (what a quantized
            base, ``MemoryJob.base_bits``, stores in fewer bits).
        trained: Elements of this rank's shards that are trained (LoRA adapters included).
        head_trained: Trained elements of the LM head on this rank (its gradient is made at the
            loss, before the layers' gradients).
        largest_layer: Elements of the largest decoder layer before FSDP sharding (what one
            gathered FSDP unit holds).
        rest: Elements outside the layers before FSDP sharding (embedding, head, final norm).
        adapted_per_layer: LoRA-adapted linear layers per decoder layer (the most of any layer).
    """

    frozen: int
    quantizable: int
    trained: int
    head_trained: int
    largest_layer: int
    rest: int
    adapted_per_layer: int


@dataclass(kw_only=True)
class _Tally:
    frozen: int = 0
    quantizable: int = 0
    trained: int = 0


def _ceil(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _search(pattern: str | None, name: str) -> bool:
    return pattern is not None and re.search(pattern, name) is not None


def _linear(job: MemoryJob, linear: LinearShape, name: str, tally: _Tally, shard: int) -> tuple[int, bool]:
    """Adds one linear weight (and its adapters) to ``tally``; returns its gathered size, adapted."""
    mesh = job.mesh
    divisor = mesh.expert_parallel if linear.expert and mesh.expert_parallel > 1 else shard
    lora = job.lora
    weight = linear.numel // mesh.tensor_parallel
    if lora is None or _search(lora.trainable, name):
        tally.trained += _ceil(weight, divisor)
        return weight, False
    tally.frozen += _ceil(weight, divisor)
    if not _search(lora.target, name):
        return weight, False
    tally.quantizable += _ceil(weight, divisor)
    adapters = lora.r * (linear.in_features + linear.out_features) * linear.count
    tally.trained += _ceil(adapters, divisor)
    return weight + adapters, True


def _rest(job: MemoryJob, tally: _Tally, *, is_first: bool, is_last: bool, shard: int) -> tuple[int, int]:
    """Adds the embedding, head and final norm this rank holds; returns (gathered size, trained head)."""
    model, tp = job.model, job.mesh.tensor_parallel
    trains_all = job.lora is None
    embedding = model.embedding_parameters // tp
    holds_embedding = is_first or (is_last and model.head is None)
    gathered = embedding if holds_embedding else 0
    if holds_embedding:
        tally.trained += _ceil(embedding, shard) if trains_all else 0
        tally.frozen += 0 if trains_all else _ceil(embedding, shard)
    head_trained = 0
    if is_last:
        gathered += model.other_parameters
        other = _ceil(model.other_parameters, shard)
        tally.trained += other if trains_all else 0
        tally.frozen += 0 if trains_all else other
        if model.head is None:
            head_trained = _ceil(embedding, shard) if trains_all else 0
        else:
            before = tally.trained
            size, _ = _linear(job, model.head, model.head.name, tally, shard)
            gathered += size
            head_trained = tally.trained - before
    return gathered, head_trained


def rank_parameters(job: MemoryJob, layers: range, *, is_first: bool, is_last: bool) -> RankParameters:
    """The parameter elements of the rank building ``layers`` (and the first or last extras)."""
    mesh, model = job.mesh, job.model
    shard = mesh.data_parallel_shard * mesh.context_parallel_shard
    tally = _Tally()
    largest, adapted_most = 0, 0
    for layer in layers:
        gathered, adapted = model.layer_other_parameters, 0
        for linear in model.layer_linears:
            size, was_adapted = _linear(job, linear, linear.name.format(layer=layer), tally, shard)
            gathered, adapted = gathered + size, adapted + int(was_adapted)
        if job.lora is None:
            tally.trained += _ceil(model.layer_other_parameters, shard)
        else:
            tally.frozen += _ceil(model.layer_other_parameters, shard)
        largest, adapted_most = max(largest, gathered), max(adapted_most, adapted)
    rest, head_trained = _rest(job, tally, is_first=is_first, is_last=is_last, shard=shard)
    return RankParameters(
        frozen=tally.frozen,
        quantizable=tally.quantizable,
        trained=tally.trained,
        head_trained=head_trained,
        largest_layer=largest,
        rest=rest,
        adapted_per_layer=adapted_most,
    )
