"""Distributed checkpoints with PyTorch DCP: atomic visibility, keep-last-N, optional async."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from d9d.loop._config_trainer import CheckpointConfig
from d9d.mesh import DistributedContext

_COMPLETE = re.compile(r"^step_(\d{9})$")
_PARTIAL_SUFFIX = ".partial"


@dataclass(kw_only=True, frozen=True)
class CheckpointLocation:
    """A complete checkpoint: the number of steps it holds and its directory."""

    step: int
    path: Path


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
    by the next save.
    """

    def __init__(self, *, config: CheckpointConfig, dist_context: DistributedContext) -> None:
        if config.directory is None:
            raise ValueError("Checkpointer needs trainer.checkpoint.directory")
        self._config = config
        self._directory = config.directory
        self._dist = dist_context
        self._pending: tuple[int, _Waitable] | None = None
        # A group of its own: an asynchronous save finishes its collectives in a background
        # thread, which must not interleave with the training step's collectives.
        group = dist.new_group(backend="gloo")
        if not isinstance(group, dist.ProcessGroup):
            raise RuntimeError(f"rank {dist_context.rank} is not part of the checkpoint process group")
        self._group: dist.ProcessGroup = group

    def latest(self) -> CheckpointLocation | None:
        """The most recent complete checkpoint, if any."""
        return self._complete()[-1] if self._complete() else None

    def _complete(self) -> list[CheckpointLocation]:
        if not self._directory.is_dir():
            return []
        found: list[CheckpointLocation] = []
        for entry in self._directory.iterdir():
            match = _COMPLETE.match(entry.name)
            if match and entry.is_dir():
                found.append(CheckpointLocation(step=int(match.group(1)), path=entry))
        return sorted(found, key=lambda c: c.step)

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
        """
        saved = dcp.FileSystemReader(str(location.path)).read_metadata().state_dict_metadata
        prefixes = {key.split(".", 1)[0] for key in saved}
        absent = [key for key in state if key not in prefixes]
        required = [key for key in absent if key not in optional]
        if required:
            raise ValueError(f"checkpoint {location.path} has no {required}; it holds {sorted(prefixes)}")
        present = {key: value for key, value in state.items() if key not in absent}
        dcp.load(present, checkpoint_id=str(location.path), process_group=self._group)
        return absent

    def save(
        self, step: int, state: dict[str, Any], on_visible: Callable[[CheckpointLocation], None]
    ) -> None:
        """Saves ``state`` as the checkpoint after ``step`` steps (collective).

        Args:
            step: Number of optimizer steps the state holds.
            state: What to save; ``Stateful`` values are asked for their state dict.
            on_visible: Called on every rank once the checkpoint is complete and visible.
        """
        self.finalize(on_visible)
        partial = Path(f"{_step_dir(self._directory, step)}{_PARTIAL_SUFFIX}")
        if self._dist.is_main_process:
            self._directory.mkdir(parents=True, exist_ok=True)
            for stale in self._directory.glob(f"*{_PARTIAL_SUFFIX}"):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier(group=self._group)
        if self._config.asynchronous:
            response = cast(
                object, dcp.async_save(state, checkpoint_id=str(partial), process_group=self._group)
            )
            # torch returns a Future, or (newer releases, asynchronous staging) a response holding one
            upload: object = getattr(response, "upload_completion", None)
            self._pending = (step, cast(_Waitable, response if upload is None else upload))
            return
        dcp.save(state, checkpoint_id=str(partial), process_group=self._group)
        self._publish(step, on_visible)

    def finalize(self, on_visible: Callable[[CheckpointLocation], None]) -> None:
        """Waits for an asynchronous save in flight and makes it visible (collective)."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        future.result()
        self._publish(step, on_visible)

    def _publish(self, step: int, on_visible: Callable[[CheckpointLocation], None]) -> None:
        dist.barrier(group=self._group)  # every rank has written its shards
        final = _step_dir(self._directory, step)
        if self._dist.is_main_process:
            partial = Path(f"{final}{_PARTIAL_SUFFIX}")
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self._directory)
            for old in self._complete()[: -self._config.keep_last]:
                shutil.rmtree(old.path, ignore_errors=True)
        dist.barrier(group=self._group)
        on_visible(CheckpointLocation(step=step, path=final))
