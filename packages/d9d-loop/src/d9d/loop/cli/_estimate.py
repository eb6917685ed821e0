"""``d9d estimate``: each rank's peak device memory from the config, before anything is built."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from pydantic import TypeAdapter, ValidationError

from d9d.loop._batch_layout import BatchLayout
from d9d.loop.cli._checkpoint_export import DEFAULT_PROVIDER, load_provider_function
from d9d.loop.cli._errors import CommandError
from d9d.loop.config._optimizer import AdamWConfig, OptimizerConfig
from d9d.loop.config._trainer import TrainerConfig
from d9d.loop.estimate import (
    DescribeMemoryContext,
    MemoryFitError,
    MemoryJob,
    check_fits,
    device_budget_bytes,
    estimate_memory,
    format_table,
    optimizer_memory,
)
from d9d.mesh import MeshParameters

_GIB = 1 << 30


def _section(config: Mapping[str, Any], key: str, adapter: TypeAdapter[Any], path: Path, default: Any) -> Any:
    value: Any = config.get(key)
    if value is None:
        if default is None:
            raise CommandError(f"{path}: no {key} section")
        return default
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        raise CommandError(f"{path}: {key} is not valid:\n{e}") from e


def _sequence_length(config: Mapping[str, Any], path: Path, given: int | None) -> int:
    if given is not None:
        return given
    dataset: Any = config.get("dataset")
    length: Any = cast(dict[str, Any], dataset).get("sequence_length") if isinstance(dataset, dict) else None
    if not isinstance(length, int) or length < 1:
        raise CommandError(f"{path}: no dataset.sequence_length (a positive integer): pass --seq-len")
    return length


def read_memory_job(
    config: Mapping[str, Any], path: Path, *, seq_len: int | None, provider: str | None
) -> MemoryJob:
    """The job of ``config``: its mesh, trainer and optimizer sections and the provider's model shape.

    Raises:
        CommandError: Naming the file, for a section that does not validate, a missing sequence
            length, or a provider that cannot be built or states no model shape.
    """
    mesh: MeshParameters = _section(config, "mesh", TypeAdapter(MeshParameters), path, MeshParameters())
    trainer: TrainerConfig = _section(config, "trainer", TypeAdapter(TrainerConfig), path, None)
    optimizer: OptimizerConfig = _section(
        config, "optimizer", TypeAdapter(OptimizerConfig), path, AdamWConfig()
    )
    length = _sequence_length(config, path, seq_len)
    try:
        layout = BatchLayout.of(
            mesh, global_batch_size=trainer.global_batch_size, microbatch_size=trainer.microbatch_size
        )
    except ValueError as e:
        raise CommandError(f"{path}: {e}") from e
    spec = provider or DEFAULT_PROVIDER
    try:
        built = load_provider_function(spec)(config)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise CommandError(f"{path}: the model provider cannot be built from it: {e}") from e
    try:
        shape = built.describe_memory(DescribeMemoryContext(mesh=mesh)).shape
    except (ValueError, OSError) as e:
        raise CommandError(f"{path}: the model's shape cannot be read: {e}") from e
    if shape is None:
        raise CommandError(f"{path}: {type(built).__name__} ({spec}) states no model shape (describe_memory)")
    return MemoryJob(
        model=shape,
        mesh=mesh,
        sequence_length=length,
        microbatch_size=trainer.microbatch_size,
        microbatches_per_step=layout.microbatches_per_step,
        peft=trainer.peft,
        optimizer=optimizer_memory(optimizer, storage_bytes=shape.storage_bytes),
    )


def estimate_command(job: MemoryJob, *, device_gib: float | None) -> str:
    """The table for ``job``; against ``device_gib`` (else this machine's first GPU, if any).

    Raises:
        CommandError: When the largest rank does not fit, saying by how much and what would fit
            (the table is printed first).
    """
    if device_gib is not None:
        budget: int | None = int(device_gib * _GIB)
    else:
        budget = device_budget_bytes(torch.device("cuda", 0)) if torch.cuda.is_available() else None
    table = format_table(estimate_memory(job), device_bytes=budget)
    if budget is not None:
        try:
            check_fits(job, budget)
        except MemoryFitError as e:
            print(table, flush=True)
            raise CommandError(str(e)) from e
    return table
