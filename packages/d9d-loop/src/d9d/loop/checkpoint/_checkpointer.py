"""Distributed checkpoints with PyTorch DCP: atomic visibility, manifests, keep-last-N, optional async."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from d9d.loop.checkpoint._directory_checks import check_checkpoint_directory, describe_write_failure
from d9d.loop.checkpoint._lock import CheckpointLock
from d9d.loop.checkpoint._manifest import (
    MANIFEST_FILE,
    FileRecord,
    Manifest,
    RunLayout,
    VerifyMode,
    check_files,
    list_files,
    read_manifest,
    record_files,
    share,
    write_manifest,
)
from d9d.loop.checkpoint._shapes import (
    describe_dtype_changes,
    dtype_changes,
    model_dtypes,
    shape_mismatches,
    tensor_shapes,
)
from d9d.loop.checkpoint._train_state import refuse_pickled_state
from d9d.loop.checkpoint._weights_only_planner import WeightsOnlyLoadPlanner
from d9d.loop.config._trainer import CheckpointConfig
from d9d.mesh import DistributedContext

_COMPLETE = re.compile(r"^step_(\d{9})$")
_PARTIAL_SUFFIX = ".partial"
_DAMAGED_SUFFIX = ".damaged"
_DCP_METADATA = ".metadata"
_T = TypeVar("_T")


class CheckpointWriteError(RuntimeError):
    """Saving a checkpoint failed; names the directory, the OS error (ENOSPC, EROFS, ...) and free space."""


class CheckpointLoadError(RuntimeError):
    """Loading a checkpoint failed (an ``Exception``, unlike DCP's ``CheckpointException``); names it."""


@dataclass(kw_only=True, frozen=True)
class CheckpointLocation:
    """A complete checkpoint: the number of steps it holds and its directory."""

    step: int
    path: Path


def complete_checkpoints(directory: Path) -> list[CheckpointLocation]:
    """The complete checkpoints (``step_NNNNNNNNN`` directories) in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found: list[CheckpointLocation] = []
    for entry in directory.iterdir():
        match = _COMPLETE.match(entry.name)
        if match and entry.is_dir():
            found.append(CheckpointLocation(step=int(match.group(1)), path=entry))
    return sorted(found, key=lambda c: c.step)


class _Waitable(Protocol):
    def result(self) -> object: ...


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:09d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Saves and restores the job's state with DCP (every rank writes its own shards).

    A checkpoint is written to ``step_NNNNNNNNN.partial`` and renamed to ``step_NNNNNNNNN`` by the
    main rank only after every rank finished writing, so a directory without the suffix is always
    complete; a crash mid-save leaves only a ``.partial`` directory, which is ignored and removed
    by the next save. The last file written before the rename is the manifest
    (``d9d_manifest.json``: every file's size and CRC-32, the run layout), which resume checks.
    """

    def __init__(
        self,
        *,
        config: CheckpointConfig,
        dist_context: DistributedContext,
        expected_bytes: int = 0,
        lock: CheckpointLock | None = None,
    ) -> None:
        """Checks the directory (a writable directory with room for ``expected_bytes``; collective).

        ``lock``: the directory's lock this job holds (``lock_checkpoint_directory``), released
        by ``close()``.

        Raises:
            DirectoryCheckError: On every rank, if the directory is unusable, naming it and why.
        """
        if config.directory is None:
            raise ValueError("Checkpointer needs trainer.checkpoint.directory")
        self._config = config
        self._directory = config.directory
        self._dist = dist_context
        self._pending: tuple[int, _Waitable, RunLayout] | None = None
        self._lock = lock
        # The context's background group: an asynchronous save finishes its collectives in a
        # background thread, which must not interleave with the training step's collectives.
        self._group: dist.ProcessGroup = dist_context.background_group()
        check_checkpoint_directory(
            self._directory,
            dist_context=dist_context,
            required_bytes=expected_bytes * dist_context.parameters.pipeline_parallel,
            group_broadcast=self._broadcast,
        )

    def close(self) -> None:
        """Releases the directory's lock, so another job may use it (idempotent)."""
        if self._lock is not None:
            self._lock.release()

    def _broadcast(self, value: _T) -> _T:
        box: list[_T] = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, 0), group=self._group)
        return box[0]

    def _gather(self, value: _T) -> list[_T]:
        out: list[_T] = [value] * dist.get_world_size(self._group)
        dist.all_gather_object(out, value, group=self._group)
        return out

    def latest(self) -> CheckpointLocation | None:
        """The most recent complete checkpoint, if any."""
        return self._complete()[-1] if self._complete() else None

    def candidates(self, *, older_than: int | None = None) -> list[CheckpointLocation]:
        """Complete checkpoints, newest first (collective: every rank sees the main rank's list).

        Args:
            older_than: Only checkpoints of fewer steps (a repeated rollback moves back).
        """
        found = [c for c in self._complete() if older_than is None or c.step < older_than]
        return self._broadcast(list(reversed(found)))

    def manifest(self, location: CheckpointLocation) -> Manifest | None:
        """The checkpoint's manifest (None for one written before manifests existed)."""
        return read_manifest(location.path)

    @property
    def verify_mode(self) -> VerifyMode:
        """How resume checks files before loading (``trainer.checkpoint.verify``)."""
        return self._config.verify

    def verify(self, location: CheckpointLocation, *, mode: VerifyMode | None = None) -> list[str]:
        """What is wrong with a checkpoint's files against its manifest; empty when intact.

        Collective: ranks check shares of the files in parallel (sizes, and CRC-32 when ``mode``,
        by default ``checkpoint.verify``, is ``checksums``); every rank returns the same list.
        """
        problems: list[str] = []
        try:
            manifest = read_manifest(location.path)
            if manifest is not None:
                mine = share(manifest.files, self._dist.rank, self._dist.world_size)
                problems = check_files(location.path, mine, mode or self._config.verify)
            elif self._dist.is_main_process and not (location.path / _DCP_METADATA).is_file():
                # an empty folder (a copy that never arrived, made by hand): nothing to load
                problems = [
                    f"{location.path} holds neither {MANIFEST_FILE} nor {_DCP_METADATA} "
                    "(an empty or unfinished folder, not a d9d checkpoint)"
                ]
        except ValueError as e:
            problems = [str(e)]
        return sorted({p for rank_problems in self._gather(problems) for p in rank_problems})

    def set_aside(
        self, locations: Sequence[CheckpointLocation], *, suffix: str = _DAMAGED_SUFFIX
    ) -> list[Path]:
        """Renames unusable checkpoints to ``step_N.damaged`` (or another ``suffix``; collective).

        They stay for inspection but no longer count as complete: resume skips them and
        ``keep_last`` never deletes a usable checkpoint to keep one of them.

        Returns:
            Their new paths.
        """
        moved = [Path(f"{location.path}{suffix}") for location in locations]
        if self._dist.is_main_process:
            for location, target in zip(locations, moved, strict=True):
                if target.exists():
                    shutil.rmtree(target, ignore_errors=True)
                os.replace(location.path, target)
            if locations:
                _fsync_dir(self._directory)
        dist.barrier(group=self._group)
        return moved

    def _complete(self) -> list[CheckpointLocation]:
        return complete_checkpoints(self._directory)

    def on_disk(self) -> list[CheckpointLocation]:
        """Complete checkpoints as this rank sees them, oldest first (not collective)."""
        return self._complete()

    def shape_mismatches(self, location: CheckpointLocation, state: dict[str, Any]) -> list[str]:
        """Tensors of ``state`` whose shape in the checkpoint differs or that it lacks (collective).

        Every rank returns the same list (pipeline ranks hold different tensors), so all refuse
        together before DCP runs.
        """
        try:
            saved = dcp.FileSystemReader(str(location.path)).read_metadata().state_dict_metadata
            mine = shape_mismatches(saved, tensor_shapes(state))
        except (OSError, EOFError, ValueError, RuntimeError, pickle.UnpicklingError):
            mine = []  # unreadable metadata is damage: load() reports it and resume falls back
        return sorted({p for rank_problems in self._gather(mine) for p in rank_problems})

    def dtype_changes(self, location: CheckpointLocation, state: dict[str, Any]) -> list[str]:
        """Model tensors stored in another dtype than in the checkpoint, one line per change (collective).

        DCP casts them as they load; the lines are for the run to say so (the config wins).
        """
        try:
            saved = dcp.FileSystemReader(str(location.path)).read_metadata().state_dict_metadata
            mine = dtype_changes(saved, model_dtypes(state))
        except (OSError, EOFError, ValueError, RuntimeError, pickle.UnpicklingError):
            mine = {}  # unreadable metadata is damage: load() reports it
        merged: dict[str, tuple[str, str]] = {}
        for rank_changes in self._gather(mine):  # pipeline ranks hold different tensors
            merged.update(rank_changes)
        return describe_dtype_changes(merged)

    def load(
        self, location: CheckpointLocation, state: dict[str, Any], *, optional: Sequence[str] = ()
    ) -> list[str]:
        """Loads ``location`` into ``state`` (values that are ``Stateful`` are restored in place).

        Args:
            location: The checkpoint.
            state: What to restore.
            optional: Top-level keys that may be absent (e.g. the RNG state of a rank that did
                not exist when the checkpoint was written, after resharding to more ranks).

        Returns:
            The optional keys that were absent and left untouched.

        Raises:
            ValueError: If a required key is absent, naming it and the checkpoint.
            PickledTrainStateError: If an older d9d stored its train state as a pickle, naming
                the checkpoint and how to go on.
            CheckpointLoadError: If its ``.metadata`` is missing or unreadable, or DCP failed on
                some rank, naming the checkpoint.
        """
        try:
            saved = dcp.FileSystemReader(str(location.path)).read_metadata().state_dict_metadata
        except (OSError, EOFError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
            # a missing or unreadable .metadata is damage: the caller falls back to an older one
            raise CheckpointLoadError(
                f"loading {location.path} failed: its {_DCP_METADATA} is unreadable: {type(e).__name__}: {e}"
            ) from e
        prefixes = {key.split(".", 1)[0] for key in saved}
        absent = [key for key in state if key not in prefixes]
        required = [key for key in absent if key not in optional]
        if required:
            raise ValueError(f"checkpoint {location.path} has no {required}; it holds {sorted(prefixes)}")
        present = {key: value for key, value in state.items() if key not in absent}
        refuse_pickled_state(location.path, saved, present)
        error = ""
        try:
            # non-tensor values load with weights_only=True: a crafted one is refused, not run
            dcp.load(
                present,
                checkpoint_id=str(location.path),
                process_group=self._group,
                planner=WeightsOnlyLoadPlanner(),
            )
        except (CheckpointException, OSError, EOFError, RuntimeError) as e:
            # CheckpointException is a BaseException: `except Exception` in user code misses it
            error = f"rank {self._dist.rank}: {type(e).__name__}: {e}"
        errors = [e for e in self._gather(error) if e]
        if errors:
            raise CheckpointLoadError(f"loading {location.path} failed: " + "; ".join(errors))
        return absent

    def save(
        self,
        step: int,
        state: dict[str, Any],
        on_visible: Callable[[CheckpointLocation], None],
        *,
        layout: RunLayout,
    ) -> None:
        """Saves ``state`` as the checkpoint after ``step`` steps (collective).

        Args:
            step: Number of optimizer steps the state holds.
            state: What to save; ``Stateful`` values are asked for their state dict.
            on_visible: Called on every rank once the checkpoint is complete and visible.
            layout: Recorded in the manifest, checked when a run resumes from it.

        Raises:
            CheckpointWriteError: Naming the directory and the OS error.
        """
        self.finalize(on_visible)
        partial = self._partial(step)
        if self._dist.is_main_process:
            self._directory.mkdir(parents=True, exist_ok=True)
            for stale in self._directory.glob(f"*{_PARTIAL_SUFFIX}"):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier(group=self._group)
        try:
            if self._config.asynchronous:
                response = cast(
                    object, dcp.async_save(state, checkpoint_id=str(partial), process_group=self._group)
                )
                # torch returns a Future, or (newer releases, asynchronous staging) a response holding one
                upload: object = getattr(response, "upload_completion", None)
                self._pending = (step, cast(_Waitable, response if upload is None else upload), layout)
                return
            dcp.save(state, checkpoint_id=str(partial), process_group=self._group)
        except (CheckpointException, OSError, RuntimeError) as e:
            raise CheckpointWriteError(describe_write_failure(partial, e)) from e
        self._publish(step, on_visible, layout)

    def _partial(self, step: int) -> Path:
        return Path(f"{_step_dir(self._directory, step)}{_PARTIAL_SUFFIX}")

    def finalize(self, on_visible: Callable[[CheckpointLocation], None]) -> None:
        """Waits for an asynchronous save in flight and makes it visible (collective)."""
        if self._pending is None:
            return
        step, future, layout = self._pending
        self._pending = None
        try:
            future.result()
        except (CheckpointException, OSError, RuntimeError) as e:
            raise CheckpointWriteError(describe_write_failure(self._partial(step), e)) from e
        self._publish(step, on_visible, layout)

    def _publish(
        self, step: int, on_visible: Callable[[CheckpointLocation], None], layout: RunLayout
    ) -> None:
        dist.barrier(group=self._group)  # every rank has written its shards
        final = _step_dir(self._directory, step)
        partial = self._partial(step)
        # Ranks checksum shares of the files in parallel; the manifest is written last, so a
        # directory renamed to its final name always has one.
        names = list_files(partial) if self._dist.is_main_process else []
        names = self._broadcast(names)
        mine = share(names, self._dist.rank, self._dist.world_size)
        records: list[FileRecord] = [r for part in self._gather(record_files(partial, mine)) for r in part]
        if self._dist.is_main_process:
            write_manifest(partial, Manifest(step=step, layout=layout, files=tuple(records)))
            _fsync_dir(partial)
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self._directory)
            for old in self._complete()[: -self._config.keep_last]:
                shutil.rmtree(old.path, ignore_errors=True)
        dist.barrier(group=self._group)
        on_visible(CheckpointLocation(step=step, path=final))
