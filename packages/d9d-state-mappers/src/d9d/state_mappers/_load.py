"""Loading a checkpoint into a module's (possibly DTensor) parameters and buffers."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from d9d.state_mappers._checkpoint_reader import SafetensorsCheckpoint
from d9d.state_mappers._errors import StateMappingError, format_names
from d9d.state_mappers._group import StateMapper
from d9d.state_mappers._local_box import local_box
from d9d.state_mappers._progress import byte_progress
from d9d.state_mappers._spec import Box, TensorSpec, box_shape, full_box
from d9d.state_mappers._streaming import build_schedule, run_schedule
from d9d.state_mappers._validation import validate_mapping


class _Destination:
    """One module tensor to fill: which box of the checkpoint it needs, and how to store it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        box: Box | None = full_box(tensor.shape)
        if isinstance(tensor, DTensor):
            box = local_box(tensor.shape, tensor.device_mesh, tensor.placements)
            if box is not None and box_shape(box) != tuple(tensor.to_local().shape):
                box = None
        # None: a layout that is not a plain box; read the whole tensor and let DTensor cut it.
        self._sliced = box is not None
        self.box = box if box is not None else full_box(tensor.shape)

    @torch.no_grad()
    def store(self, value: torch.Tensor) -> None:
        tensor = self._tensor
        if not isinstance(tensor, DTensor):
            tensor.copy_(value)
            return
        local = tensor.to_local()
        if self._sliced:
            local.copy_(value)
            return
        distributed = distribute_tensor(
            value.to(local.device), tensor.device_mesh, tensor.placements, src_data_rank=None
        )
        local.copy_(distributed.to_local())


def load_module_state(
    source: Path | str | SafetensorsCheckpoint,
    module: nn.Module,
    mapper: StateMapper,
    *,
    strict: bool = True,
    show_progress: bool = True,
) -> None:
    """Streams a safetensors checkpoint through ``mapper`` into ``module``'s state, in place.

    Targets are the entries of ``module.state_dict()``: parameters and persistent buffers,
    which must be materialized (not on the meta device). For a DTensor parameter each rank reads
    only the slice its local shard comes from, so an N-way sharded load reads about 1/N of the
    checkpoint per rank; no communication happens. Everything is validated against the module
    before any tensor data is read.

    Args:
        source: A directory of safetensors files (with or without an index), one file, or an
            opened ``SafetensorsCheckpoint``.
        module: The module to fill.
        mapper: Maps checkpoint names to ``module.state_dict()`` names.
        strict: Whether checkpoint tensors that no group consumes are an error.
        show_progress: Whether to show a progress bar (main rank, terminal only).

    Raises:
        CheckpointFormatError: If a source file or the index is missing or malformed.
        StateMappingError: If the mapper does not fit the checkpoint or the module.
    """
    checkpoint = source if isinstance(source, SafetensorsCheckpoint) else SafetensorsCheckpoint(source)
    state = module.state_dict(keep_vars=True)
    on_meta = [name for name, tensor in state.items() if tensor.device.type == "meta"]
    if on_meta:
        raise StateMappingError(
            f"module tensors are on the meta device; materialize them first: {format_names(on_meta)}"
        )
    targets = {name: TensorSpec.of(tensor) for name, tensor in state.items()}
    mapping = validate_mapping(mapper, checkpoint.specs, targets, strict=strict)
    destinations = {name: _Destination(tensor) for name, tensor in state.items()}
    plans = [
        group.plan(specs, {o: destinations[o].box for o in group.outputs})
        for group, specs in zip(mapping.groups, mapping.input_specs, strict=True)
    ]
    schedule = build_schedule(checkpoint, plans)

    def emit(name: str, value: torch.Tensor) -> None:
        destinations[name].store(value)

    with byte_progress(schedule.read_bytes, f"loading {checkpoint.path.name}", show=show_progress) as bar:
        run_schedule(checkpoint, plans, schedule, emit, progress=bar)
