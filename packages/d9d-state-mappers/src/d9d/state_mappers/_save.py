"""Saving a module's (possibly DTensor) state through a mapper, each tensor written once."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from d9d.state_mappers._checkpoint_writer import CheckpointWriter, PlannedTensor, check_target
from d9d.state_mappers._convert import DEFAULT_MAX_SHARD_SIZE_BYTES
from d9d.state_mappers._errors import StateMappingError
from d9d.state_mappers._group import MapperGroup, StateMapper
from d9d.state_mappers._progress import byte_progress
from d9d.state_mappers._spec import TensorPiece, TensorSpec, full_box
from d9d.state_mappers._validation import validate_mapping


def _assign_owners(groups: Sequence[MapperGroup], specs: Mapping[str, TensorSpec], world: int) -> list[int]:
    """Gives each group to the rank with the fewest output bytes so far (deterministic)."""
    load = [0] * world
    owners: list[int] = []
    for group in groups:
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += sum(specs[name].nbytes for name in group.outputs)
        owners.append(owner)
    return owners


def _check_same_layout(specs: Mapping[str, TensorSpec], group: ProcessGroup | None) -> None:
    digest = hashlib.sha256(repr(sorted((n, str(s)) for n, s in specs.items())).encode()).hexdigest()
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        raise StateMappingError(
            f"ranks hold different state layouts (names, shapes or dtypes differ): digests {digests}; "
            "every rank of the saving group must pass the same module layout"
        )


def save_module_state(
    target: Path | str,
    module: nn.Module,
    mapper: StateMapper,
    *,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
    overwrite: bool = False,
    process_group: ProcessGroup | None = None,
    show_progress: bool = True,
) -> None:
    """Writes ``module``'s state through ``mapper`` as a sharded safetensors checkpoint with an index.

    When the module holds DTensors (or ``process_group`` is given) the call is collective over
    ``process_group`` (the default group when None): every rank passes the same module layout,
    the groups are shared out between ranks, a DTensor is gathered group by group (never the
    whole model at once), and each output is written once, by the rank that owns its file. Files
    go to a temporary directory on a filesystem all ranks share and are renamed into place only
    when complete. Without DTensors and without a group, this is a single-process write.

    Args:
        target: The directory to create.
        module: The module whose ``state_dict()`` is saved.
        mapper: Maps ``module.state_dict()`` names to checkpoint names.
        max_shard_size_bytes: Largest file to write (a larger single tensor gets its own file).
        overwrite: Whether to replace an existing non-empty target.
        process_group: The ranks saving together; see above.
        show_progress: Whether to show a progress bar (main rank, terminal only).

    Raises:
        StateMappingError: If the mapper does not fit the module's state.
        FileExistsError: If ``target`` exists, is not empty and ``overwrite`` is False.
        RuntimeError: If writing failed on any rank; nothing is left at the target.
    """
    target = Path(target)
    state = module.state_dict()
    collective = process_group is not None or any(isinstance(t, DTensor) for t in state.values())
    if collective and not dist.is_initialized():
        raise RuntimeError("saving DTensors needs torch.distributed to be initialized")
    rank = dist.get_rank(process_group) if collective else 0
    world = dist.get_world_size(process_group) if collective else 1
    check_target(target, overwrite)
    specs = {name: TensorSpec.of(tensor) for name, tensor in state.items()}
    if collective:
        _check_same_layout(specs, process_group)
    mapping = validate_mapping(mapper, specs)
    owners = _assign_owners(mapping.groups, mapping.output_specs, world)
    plans = [
        group.plan(group_specs, {o: full_box(mapping.output_specs[o].shape) for o in group.outputs})
        for group, group_specs in zip(mapping.groups, mapping.input_specs, strict=True)
    ]
    tensors = [
        PlannedTensor(name=name, spec=mapping.output_specs[name], owner=owner)
        for group, owner in zip(mapping.groups, owners, strict=True)
        for name in sorted(group.outputs)
    ]
    total = sum(t.spec.nbytes for t in tensors)
    failure: Exception | None = None
    with (
        byte_progress(total, f"saving {target.name}", show=show_progress) as bar,
        CheckpointWriter(
            target,
            tensors,
            max_shard_size_bytes=max_shard_size_bytes,
            overwrite=overwrite,
            group=process_group,
            collective=collective,
        ) as writer,
    ):
        for group, plan, owner in zip(mapping.groups, plans, owners, strict=True):
            mine = owner == rank and failure is None
            pieces: dict[str, TensorPiece] = {}
            for name in plan.input_boxes:
                tensor = state[name]
                # Every rank takes part in the gather, in the same order; only the owner keeps it.
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                if mine:
                    pieces[name] = TensorPiece(data=full.detach(), box=full_box(full.shape))
            if mine:
                try:
                    for name, value in plan.run(pieces).items():
                        writer.write(name, value)
                except Exception as error:
                    if not collective:
                        raise
                    # Keep joining the gathers so the other ranks do not hang; commit reports it.
                    failure = error
            del pieces
            bar.update(sum(mapping.output_specs[name].nbytes for name in group.outputs))
        try:
            writer.commit(failure=failure)
        except RuntimeError as error:
            raise error from failure
