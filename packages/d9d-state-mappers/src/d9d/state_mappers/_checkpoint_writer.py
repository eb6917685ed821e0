"""Writing Hugging Face style sharded safetensors checkpoints atomically, tensor by tensor.

Every tensor's file and byte offset is planned up front from specs, so each file's header is
written first and each tensor is written at its place the moment it exists: nothing is buffered.
Files go to a temporary directory beside the target, which is renamed into place only once every
tensor of every file has been written and synced, so a crash never leaves a checkpoint at the
target that looks complete.

In a collective write, every rank plans the same files; each file belongs to one rank, which
alone writes it, and rank 0 of the group writes the index and renames the directory.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from d9d.state_mappers._background_writer import DEFAULT_WRITE_BEHIND_BYTES, BackgroundWriter
from d9d.state_mappers._checkpoint_reader import INDEX_FILE
from d9d.state_mappers._errors import format_names
from d9d.state_mappers._safetensors_format import build_header
from d9d.state_mappers._spec import TensorSpec

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class PlannedTensor:
    """A tensor to write: its name, spec and the rank (in the writing group) that writes it."""

    name: str
    spec: TensorSpec
    owner: int = 0


@dataclass(kw_only=True)
class _PlannedFile:
    file_name: str
    owner: int
    specs: dict[str, TensorSpec]
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict[str, int])
    size: int = 0


def plan_files(tensors: Sequence[PlannedTensor], max_shard_size_bytes: int) -> list[_PlannedFile]:
    """Packs each owner's tensors, in order, into files of at most ``max_shard_size_bytes``.

    A single tensor larger than the limit gets a file of its own.
    """
    if max_shard_size_bytes <= 0:
        raise ValueError(f"max_shard_size_bytes must be positive, got {max_shard_size_bytes}")
    files: list[_PlannedFile] = []
    for owner in sorted({t.owner for t in tensors}):
        current: _PlannedFile | None = None
        current_bytes = 0
        for tensor in (t for t in tensors if t.owner == owner):
            if current is None or (
                current.specs and current_bytes + tensor.spec.nbytes > max_shard_size_bytes
            ):
                current = _PlannedFile(file_name="", owner=owner, specs={})
                current_bytes = 0
                files.append(current)
            current.specs[tensor.name] = tensor.spec
            current_bytes += tensor.spec.nbytes
    for number, planned in enumerate(files, start=1):
        planned.file_name = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        planned.header, planned.offsets = build_header(list(planned.specs.items()))
        planned.size = len(planned.header) + sum(s.nbytes for s in planned.specs.values())
    return files


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """Writes planned tensors into a sharded safetensors checkpoint with an index, atomically.

    Use ``write`` for every tensor this rank owns, then ``commit`` (collective when ``group`` is
    given); ``abort`` (or leaving a ``with`` block by an exception) removes the temporary files.
    """

    def __init__(
        self,
        target: Path,
        tensors: Sequence[PlannedTensor],
        *,
        max_shard_size_bytes: int,
        overwrite: bool = False,
        group: ProcessGroup | None = None,
        collective: bool = False,
        progress: tqdm[NoReturn] | None = None,
        write_behind_bytes: int = DEFAULT_WRITE_BEHIND_BYTES,
    ) -> None:
        self._target = Path(target)
        self._overwrite = overwrite
        self._collective = collective
        self._group = group
        self._rank = dist.get_rank(group) if collective else 0
        self._progress = progress
        check_target(self._target, overwrite)
        self._files = plan_files(tensors, max_shard_size_bytes)
        self._file_of = {name: f for f in self._files for name in f.specs}
        self._written: set[str] = set()
        self._unwritten = {f.file_name: len(f.specs) for f in self._files}
        self._closed: set[str] = set()
        self._handles: dict[str, io.FileIO] = {}
        self._background = BackgroundWriter(max_bytes=write_behind_bytes)
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d9d-checkpoint-sync")
        self._syncs: list[Future[None]] = []
        self._committed = False
        token = uuid.uuid4().hex[:12]
        if collective:
            token = str(_broadcast_from_first(token, group))
        self._tmp = self._target.parent / f".{self._target.name}.partial-{token}"
        if self._rank == 0:
            remove_stale_leftovers(self._target)
            self._tmp.mkdir(parents=True)
        if collective:
            dist.barrier(group=group)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self._committed:
            self.abort()

    def owns(self, name: str) -> bool:
        """Whether this rank writes tensor ``name``."""
        return self._file_of[name].owner == self._rank

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Queues one planned tensor (a full, non-distributed tensor owned by this rank) for writing.

        The bytes go to disk on a background thread; a file is synced and closed as soon as its
        last tensor is written. ``tensor`` must not be modified until ``commit`` returns.
        """
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} is not part of the planned checkpoint")
        planned = self._file_of[name]
        if planned.owner != self._rank:
            raise ValueError(f"tensor {name!r} is written by rank {planned.owner}, not rank {self._rank}")
        if name in self._written:
            raise ValueError(f"tensor {name!r} was already written")
        if isinstance(tensor, DTensor):
            raise TypeError(f"tensor {name!r} is a DTensor; gather it to a full tensor before writing")
        spec = TensorSpec.of(tensor)
        if spec != planned.specs[name]:
            raise ValueError(f"tensor {name!r} is {spec} but was planned as {planned.specs[name]}")
        data = tensor.detach().to("cpu").contiguous()
        self._written.add(name)
        self._unwritten[planned.file_name] -= 1
        last = self._unwritten[planned.file_name] == 0
        offset = planned.offsets[name]

        def job() -> None:
            if data.numel() > 0:
                handle = self._handle(planned)
                handle.seek(offset)
                view = data.reshape(-1).view(torch.uint8).numpy().data
                while view:
                    count = handle.write(view)
                    view = view[count:]
            if last:
                self._close_file(planned)

        self._background.submit(job, spec.nbytes)
        if self._progress is not None:
            self._progress.update(spec.nbytes)

    def _handle(self, planned: _PlannedFile) -> io.FileIO:
        handle = self._handles.get(planned.file_name)
        if handle is None:
            handle = io.FileIO(self._tmp / planned.file_name, "w")
            handle.write(planned.header)
            handle.truncate(planned.size)
            self._handles[planned.file_name] = handle
        return handle

    def _close_file(self, planned: _PlannedFile) -> None:
        # Syncing waits for the disk; a thread of its own lets the next file's writes go on meanwhile.
        handle = self._handle(planned)
        del self._handles[planned.file_name]
        self._closed.add(planned.file_name)
        self._syncs.append(self._syncer.submit(_sync_and_close, handle))

    def _finish_own_files(self) -> None:
        self._background.drain()
        for planned in self._files:
            if planned.owner != self._rank or planned.file_name in self._closed:
                continue
            unwritten = set(planned.specs) - self._written
            if unwritten:
                raise RuntimeError(f"checkpoint incomplete: tensors never written: {format_names(unwritten)}")
            self._close_file(planned)
        for sync in self._syncs:
            sync.result()

    def _publish(self) -> None:
        weight_map = {name: f.file_name for f in self._files for name in f.specs}
        index = {
            "metadata": {"total_size": sum(s.nbytes for f in self._files for s in f.specs.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with (self._tmp / INDEX_FILE).open("w") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self._tmp)
        check_target(self._target, self._overwrite)
        old: Path | None = None
        if self._target.exists():
            old = self._target.parent / f".{self._target.name}.replaced-{uuid.uuid4().hex[:12]}"
            self._target.rename(old)
        try:
            self._tmp.rename(self._target)
        except OSError:
            if old is not None:
                old.rename(self._target)  # the target stays as it was
            raise
        _fsync_dir(self._target.parent)
        if old is not None:
            # The new checkpoint is in place: failing to remove the old one is no write failure.
            try:
                _remove(old)
            except OSError as problem:
                warnings.warn(
                    f"{self._target} was written; its previous content is left at {old}: {problem}",
                    stacklevel=2,
                )

    def commit(self, *, failure: BaseException | None = None) -> None:
        """Checks every tensor was written, syncs, writes the index and renames into place.

        Collective when the writer is: every rank reports whether its files are complete (or
        passes the ``failure`` that stopped it producing them); on any failure every rank raises
        and nothing appears at the target.
        """
        error: str | None = None if failure is None else f"rank {self._rank}: {failure!r}"
        try:
            if error is None:
                self._finish_own_files()
        except (RuntimeError, OSError) as problem:
            error = f"rank {self._rank}: {problem}"
        if self._collective:
            errors: list[str | None] = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(errors, error, group=self._group)
            failures: list[str] = [e for e in errors if e is not None]
        else:
            failures: list[str] = [error] if error is not None else []
        if not failures and self._rank == 0:
            try:
                self._publish()
            except OSError as problem:
                failures.append(f"rank 0: publishing {self._target}: {problem}")
        if self._collective:
            failures = [str(f) for f in _broadcast_from_first(tuple(failures), self._group)]
        self._background.close()
        self._syncer.shutdown(wait=True)
        if failures:
            self.abort()
            raise RuntimeError(
                f"writing {self._target} failed; nothing was written there:\n" + "\n".join(failures)
            )
        self._committed = True

    def abort(self) -> None:
        """Closes and removes the temporary files; the target is left as it was. Not collective."""
        self._background.close()
        self._syncer.shutdown(wait=True)
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        self._committed = True
        if self._rank == 0 and self._tmp.exists():
            shutil.rmtree(self._tmp, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _process_start_time() -> float | None:
    """When this process started (seconds since the epoch), where the OS says so (Linux)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + float(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def remove_stale_leftovers(target: Path) -> list[Path]:
    """Removes ``.<target>.partial-*`` / ``.replaced-*`` siblings left by a killed earlier process.

    Only those last modified before this process started go: a write in progress elsewhere is
    left alone. Where the process start time is unknown (not Linux), they are named in a warning.

    Returns:
        The leftovers removed.
    """
    leftovers = [
        p
        for pattern in (f".{target.name}.partial-*", f".{target.name}.replaced-*")
        for p in target.parent.glob(pattern)
    ]
    if not leftovers:
        return []
    started = _process_start_time()
    if started is None:
        names = ", ".join(str(p) for p in leftovers)
        warnings.warn(
            f"leftovers of an earlier interrupted write (remove them by hand): {names}", stacklevel=2
        )
        return []
    removed: list[Path] = []
    for path in leftovers:
        try:
            if path.stat().st_mtime < started - 1.0:
                _remove(path)
                removed.append(path)
        except OSError:
            continue  # another process removed it first, or it is not ours to remove
    return removed


def _sync_and_close(handle: io.FileIO) -> None:
    try:
        handle.flush()
        os.fsync(handle.fileno())
    finally:
        handle.close()


def check_target(target: Path, overwrite: bool) -> None:
    """Raises unless ``target`` is absent, an empty directory, or may be overwritten."""
    if target.exists() and not overwrite and not (target.is_dir() and not any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not empty; pass overwrite=True to replace it")


def _broadcast_from_first(value: _T, group: ProcessGroup | None) -> _T:
    """``value`` of the group's first rank, on every rank of the group."""
    box: list[_T] = [value]
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return box[0]
