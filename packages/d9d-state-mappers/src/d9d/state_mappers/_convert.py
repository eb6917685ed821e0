"""One-call checkpoint conversion: a safetensors source through a mapper into a new checkpoint."""

from __future__ import annotations

from pathlib import Path

from d9d.state_mappers._checkpoint_reader import SafetensorsCheckpoint
from d9d.state_mappers._checkpoint_writer import CheckpointWriter, PlannedTensor, check_target
from d9d.state_mappers._group import StateMapper
from d9d.state_mappers._progress import byte_progress
from d9d.state_mappers._spec import full_box
from d9d.state_mappers._streaming import build_schedule, run_schedule
from d9d.state_mappers._validation import validate_mapping

DEFAULT_MAX_SHARD_SIZE_BYTES = 5 * 2**30


def convert_checkpoint(
    source: Path | str | SafetensorsCheckpoint,
    target: Path | str,
    mapper: StateMapper,
    *,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
    strict: bool = True,
    overwrite: bool = False,
    show_progress: bool = True,
) -> None:
    """Streams a safetensors checkpoint through ``mapper`` into a new sharded checkpoint.

    Reads one tensor at a time, runs each group as soon as its inputs are read and writes its
    outputs at once, so memory holds only the groups in flight. Everything is validated before
    any tensor is read, and the target appears only when complete.

    Args:
        source: A directory of safetensors files (with or without an index) or one file.
        target: The directory to create (``model-XXXXX-of-XXXXX.safetensors`` and an index).
        mapper: Maps source names to target names.
        max_shard_size_bytes: Largest file to write (a larger single tensor gets its own file).
        strict: Whether source tensors that no group consumes are an error.
        overwrite: Whether to replace an existing non-empty target.
        show_progress: Whether to show a progress bar (on a terminal only).

    Raises:
        CheckpointFormatError: If a source file or the index is missing or malformed.
        StateMappingError: If the mapper does not fit the source.
        FileExistsError: If ``target`` exists, is not empty and ``overwrite`` is False.
    """
    target = Path(target)
    check_target(target, overwrite)
    checkpoint = source if isinstance(source, SafetensorsCheckpoint) else SafetensorsCheckpoint(source)
    mapping = validate_mapping(mapper, checkpoint.specs, strict=strict)
    plans = [
        group.plan(specs, {o: full_box(mapping.output_specs[o].shape) for o in group.outputs})
        for group, specs in zip(mapping.groups, mapping.input_specs, strict=True)
    ]
    schedule = build_schedule(checkpoint, plans)
    tensors = [
        PlannedTensor(name=name, spec=mapping.output_specs[name])
        for index in schedule.run_order
        for name in sorted(mapping.groups[index].outputs)
    ]
    with (
        byte_progress(schedule.read_bytes, f"converting {checkpoint.path.name}", show=show_progress) as bar,
        CheckpointWriter(
            target, tensors, max_shard_size_bytes=max_shard_size_bytes, overwrite=overwrite
        ) as writer,
    ):
        run_schedule(checkpoint, plans, schedule, writer.write, progress=bar)
        writer.commit()
