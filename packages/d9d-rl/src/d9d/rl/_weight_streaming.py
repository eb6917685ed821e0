"""Streaming a trainer's (sharded) weights to a rollout engine, a bounded batch at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.rl._rollout_engine import WeightReceiver
from d9d.state_mappers import (
    StateMapper,
    TensorPiece,
    TensorSpec,
    identity_mapper_from_module,
    validate_mapping,
)

DEFAULT_BATCH_BYTES = 256 * 2**20


@dataclass(kw_only=True, frozen=True)
class StreamReport:
    """What one ``stream_weights`` call sent.

    Attributes:
        tensors: Named tensors sent.
        bytes_sent: Their total size.
        batches: ``update_weights`` calls made.
        largest_batch_bytes: Size of the largest batch: the extra memory this rank held at once
            (plus one mapper group's gathered inputs while it runs).
    """

    tensors: int
    bytes_sent: int
    batches: int
    largest_batch_bytes: int


def _full_box(shape: torch.Size) -> tuple[tuple[int, int], ...]:
    return tuple((0, int(size)) for size in shape)


@torch.no_grad()
def stream_weights(
    module: nn.Module,
    receiver: WeightReceiver,
    *,
    mapper: StateMapper | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> StreamReport:
    """Sends ``module``'s state through ``mapper`` to ``receiver.update_weights``, in batches.

    The mapper's groups run in order; each group's DTensor inputs are gathered with
    ``full_tensor()`` (a collective over their mesh, so every rank of the module's mesh calls
    this, in the same order) and its outputs join a batch that is sent once it reaches
    ``batch_bytes`` and then dropped. No rank ever holds more than one batch plus one group of
    full tensors: the whole model never exists in one place. Every rank sends to its own
    receiver (a colocated engine per rank).

    Args:
        module: A model stage (plain tensors or DTensors under any placement).
        receiver: The rollout engine (anything with ``update_weights``).
        mapper: Maps the module's state-dict names to the receiver's names (e.g. d9d-hf's
            ``decoder_export_mapper`` for an engine that takes Hugging Face names); None is the
            identity.
        batch_bytes: Send once this many bytes are pending (a larger single tensor goes alone).

    Raises:
        StateMappingError: If the mapper does not fit the module's state.
    """
    if batch_bytes <= 0:
        raise ValueError(f"batch_bytes={batch_bytes} must be positive")
    state = module.state_dict()
    specs = {name: TensorSpec.of(tensor) for name, tensor in state.items()}
    mapping = validate_mapping(mapper if mapper is not None else identity_mapper_from_module(module), specs)
    pending: list[tuple[str, torch.Tensor]] = []
    pending_bytes = 0
    tensors = sent = batches = largest = 0

    def flush() -> None:
        nonlocal pending, pending_bytes, sent, batches, largest
        if pending:
            receiver.update_weights(pending)
            sent += pending_bytes
            batches += 1
            largest = max(largest, pending_bytes)
        pending, pending_bytes = [], 0

    for group, group_specs in zip(mapping.groups, mapping.input_specs, strict=True):
        plan = group.plan(
            group_specs, {o: _full_box(torch.Size(mapping.output_specs[o].shape)) for o in group.outputs}
        )
        pieces: dict[str, TensorPiece] = {}
        for name in plan.input_boxes:
            tensor = state[name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            pieces[name] = TensorPiece(data=full.detach(), box=_full_box(full.shape))
        outputs = plan.run(pieces)
        del pieces
        for name in sorted(outputs):
            value = outputs[name]
            pending.append((name, value))
            pending_bytes += value.numel() * value.element_size()
            tensors += 1
        if pending_bytes >= batch_bytes:
            flush()
    flush()
    return StreamReport(tensors=tensors, bytes_sent=sent, batches=batches, largest_batch_bytes=largest)
