"""Checks of output directories before a run starts, and write errors that say what went wrong."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, cast

import torch
from torch import nn

from d9d.mesh import DistributedContext


class DiskUsage(NamedTuple):
    """Bytes of a filesystem, as ``shutil.disk_usage`` reports them."""

    total: int
    used: int
    free: int


DiskUsageFn = Callable[[Path], DiskUsage]


class DirectoryCheckError(OSError):
    """An output directory is unusable; the message names it and the reason."""


def _disk_usage(path: Path) -> DiskUsage:
    usage = shutil.disk_usage(path)
    return DiskUsage(usage.total, usage.used, usage.free)


def _os_error(error: OSError) -> str:
    code = errno.errorcode.get(error.errno or 0, "")
    reason = error.strerror or str(error)
    return f"{code}: {reason}" if code else reason


def check_output_directory(
    path: Path, *, what: str, required_bytes: int = 0, disk_usage: DiskUsageFn = _disk_usage
) -> None:
    """Makes sure ``path`` is (or can become) a writable directory with room for ``required_bytes``.

    Creates the directory, writes and removes a probe file in it (``os.access`` is not enough:
    root passes it on a read-only mount), then compares the free space with ``required_bytes``.

    Args:
        path: The directory.
        what: The config key or role named in errors (``trainer.checkpoint.directory``).
        required_bytes: Room needed for one output (0: no space check).
        disk_usage: Reports a filesystem's sizes (``shutil.disk_usage``; replaceable in tests).

    Raises:
        DirectoryCheckError: Naming ``what``, the path and the OS error (ENOTDIR, EROFS, EACCES,
            ENOSPC, ...).
    """
    if path.exists() and not path.is_dir():
        raise DirectoryCheckError(errno.ENOTDIR, f"{what}={path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DirectoryCheckError(
            e.errno or errno.EIO, f"{what}={path} cannot be created: {_os_error(e)}"
        ) from e
    _write_probe(path, what)
    free = disk_usage(path).free
    if required_bytes > free:
        raise DirectoryCheckError(
            errno.ENOSPC,
            f"{what}={path} has {free / 2**20:.1f} MiB free; one checkpoint needs about "
            f"{required_bytes / 2**20:.1f} MiB (ENOSPC expected at the first save)",
        )


def _write_probe(path: Path, what: str) -> None:
    """Writes and removes a probe file; a failure to write is the error reported, never the cleanup's.

    On a read-only mount even removing a probe that was never created fails (EROFS), and a
    failed removal must not replace the reason the directory is unusable.
    """
    probe = path / f".d9d-write-probe-{os.getpid()}"
    try:
        with probe.open("wb") as f:
            f.write(b"d9d")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise DirectoryCheckError(
            e.errno or errno.EIO, f"{what}={path} is not writable: {_os_error(e)}"
        ) from e
    try:
        probe.unlink()
    except OSError as e:
        raise DirectoryCheckError(
            e.errno or errno.EIO, f"{what}={path} accepts files but cannot delete them: {_os_error(e)}"
        ) from e


def estimate_checkpoint_bytes(models: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of one checkpoint of these stages: parameters, buffers and the optimizer's state.

    Sizes are global (a DTensor counts whole). The optimizer's per-parameter state is estimated
    from its settings, before it exists: two tensors for Adam-like optimizers (``betas``), one
    with ``momentum``, else none.
    """
    params = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
    buffers = sum(b.numel() * b.element_size() for m in models for b in m.buffers())
    defaults = optimizer.defaults
    per_param = 2 if "betas" in defaults else (1 if defaults.get("momentum") else 0)
    trainable = sum(p.numel() * 4 for m in models for p in m.parameters() if p.requires_grad)
    return params + buffers + per_param * trainable


def check_checkpoint_directory(
    path: Path,
    *,
    dist_context: DistributedContext,
    required_bytes: int,
    group_broadcast: Callable[[tuple[int, str] | None], tuple[int, str] | None],
) -> None:
    """Runs ``check_output_directory`` on the main rank; every rank raises the same error.

    Args:
        path: The checkpoint directory.
        dist_context: The job's context (the main rank checks).
        required_bytes: Room for one checkpoint.
        group_broadcast: Sends the main rank's result (None when fine) to every rank.
    """
    problem: tuple[int, str] | None = None
    if dist_context.is_main_process:
        try:
            check_output_directory(path, what="trainer.checkpoint.directory", required_bytes=required_bytes)
        except DirectoryCheckError as e:
            problem = (e.errno or errno.EIO, e.strerror or str(e))
    problem = group_broadcast(problem)
    if problem is not None:
        raise DirectoryCheckError(*problem)


def describe_write_failure(path: Path, error: BaseException) -> str:
    """What went wrong writing ``path``: the OS errors found in ``error`` (or its causes) and free space."""
    reasons: list[str] = []
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            where = f" ({current.filename})" if current.filename else ""
            reasons.append(f"{_os_error(current)}{where}")
        failures: object = getattr(current, "failures", None)  # DCP: rank -> (error, traceback)
        if isinstance(failures, dict):
            for wrapped in cast(dict[object, object], failures).values():
                if isinstance(wrapped, tuple):
                    first: object = cast(tuple[object, ...], wrapped)[0]
                    if isinstance(first, BaseException):
                        pending.append(first)
        for nested in (current.__cause__, current.__context__):
            if nested is not None:
                pending.append(nested)
    try:
        free = f"{_disk_usage(path if path.exists() else path.parent).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    detail = "; ".join(dict.fromkeys(reasons)) or f"{type(error).__name__}: {error}"
    return f"writing {path} failed: {detail} ({free} there)"
