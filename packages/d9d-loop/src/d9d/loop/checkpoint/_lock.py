"""One job per checkpoint directory: a lock file naming its holder, taken before any work.

Two jobs writing one directory delete each other's checkpoints (``keep_last``) and resume from
each other's steps. The main rank creates ``.d9d-lock`` with ``O_EXCL`` and writes its host,
pid, process start time and when it took the lock; every rank learns the outcome before the
model is built. A lock whose holder is gone is stale: on the same host, a pid that no longer runs
(or that now belongs to a process started at another time) is taken over with a warning. A lock
of another host cannot be checked from here (no heartbeat: a job stalled in a long step would
look dead), so it is refused with the command that removes it.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

from d9d.mesh import DistributedContext

LOCK_FILE = ".d9d-lock"


class CheckpointDirectoryLockedError(RuntimeError):
    """Another job holds the checkpoint directory; names its host, pid and start time."""


@dataclass(kw_only=True, frozen=True)
class LockHolder:
    """Who holds a checkpoint directory.

    Attributes:
        host: The holder's host name.
        pid: The holder's process id (the main rank's).
        process_start: The process's start time in clock ticks since boot (``/proc/<pid>/stat``;
            empty where unknown), so a pid reused by another process is not mistaken for it.
        since: When the lock was taken (UTC, ISO 8601).
    """

    host: str
    pid: int
    process_start: str
    since: str

    def describe(self) -> str:
        """``host H, pid P, since T``."""
        return f"host {self.host}, pid {self.pid}, since {self.since}"


def _process_start(pid: int) -> str:
    """The start time of process ``pid`` (Linux); empty where /proc is not there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # the command name (field 2) may hold spaces and parentheses: count fields after the last ')'
    return stat.rsplit(")", 1)[-1].split()[19]


def _running(holder: LockHolder) -> bool:
    """Whether the holder (a process of this host) still runs."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists under another user
    return not holder.process_start or _process_start(holder.pid) in ("", holder.process_start)


def _me() -> LockHolder:
    return LockHolder(
        host=socket.gethostname(),
        pid=os.getpid(),
        process_start=_process_start(os.getpid()),
        since=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def _read(path: Path) -> LockHolder | None:
    """The holder recorded in ``path``; None when the file is unreadable or half written."""
    try:
        raw: object = json.loads(path.read_text())
        if not isinstance(raw, dict):
            return None
        fields = cast(dict[str, object], raw)
        return LockHolder(
            host=str(fields["host"]),
            pid=int(str(fields["pid"])),
            process_start=str(fields.get("process_start", "")),
            since=str(fields.get("since", "")),
        )
    except (OSError, ValueError, KeyError):
        return None


def _create(path: Path, holder: LockHolder) -> bool:
    """Creates the lock file exclusively; False when it exists already."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(holder), f)
        f.flush()
        os.fsync(f.fileno())
    return True


class CheckpointLock:
    """The lock this job holds on a checkpoint directory (only the main rank holds the file).

    Released by ``release()`` (the checkpointer's ``close()``) or at interpreter exit.
    """

    def __init__(self, path: Path | None, holder: LockHolder | None) -> None:
        self._path = path
        self._holder = holder
        if path is not None:
            atexit.register(self.release)

    @property
    def path(self) -> Path | None:
        """The lock file this process holds (None on other ranks, or once released)."""
        return self._path

    def release(self) -> None:
        """Removes the lock file if it still names this job (idempotent)."""
        path, self._path = self._path, None
        if path is None:
            return
        atexit.unregister(self.release)
        if _read(path) == self._holder:
            path.unlink(missing_ok=True)


def _try_lock(directory: Path, warn: Callable[[str], None]) -> tuple[LockHolder | None, str | None]:
    """Takes the lock on this process; returns (the holder written, None) or (None, why not)."""
    path = directory / LOCK_FILE
    me = _me()
    for _ in range(3):  # a holder that releases or a stale lock removed between the checks
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if _create(path, me):
                return me, None
        except OSError:
            return None, None  # an unusable directory: the directory check names what is wrong
        holder = _read(path)
        if holder is None:
            return None, (
                f"trainer.checkpoint.directory={directory} holds an unreadable lock file {path}; "
                f"if no other job uses this directory, delete it: rm {path}"
            )
        if holder.host != me.host:
            return None, (
                f"trainer.checkpoint.directory={directory} is in use by another job ({holder.describe()}); "
                f"two jobs on one directory delete and resume each other's checkpoints. Use another "
                f"directory, or, if that job is no longer running, delete its lock: rm {path}"
            )
        if _running(holder):
            return None, (
                f"trainer.checkpoint.directory={directory} is in use by another job ({holder.describe()}, "
                "still running); two jobs on one directory delete and resume each other's checkpoints. "
                "Wait for it to end or use another directory"
            )
        warn(
            f"trainer.checkpoint.directory={directory}: taking over the lock of a job that is gone "
            f"({holder.describe()}, no longer running)"
        )
        path.unlink(missing_ok=True)
    return None, f"trainer.checkpoint.directory={directory}: the lock {path} keeps changing hands"


def lock_checkpoint_directory(
    directory: Path,
    *,
    dist_context: DistributedContext,
    broadcast: Callable[[str | None], str | None],
) -> CheckpointLock:
    """Takes the directory's lock on the main rank; every rank raises the same refusal (collective).

    Args:
        directory: The checkpoint directory.
        dist_context: The job's context (its main rank takes the lock).
        broadcast: Sends the main rank's refusal (None when locked) to every rank.

    Raises:
        CheckpointDirectoryLockedError: On every rank, if another job holds the directory, naming
            it (host, pid, since) and how to proceed.
    """
    holder: LockHolder | None = None
    problem: str | None = None
    if dist_context.is_main_process:
        holder, problem = _try_lock(directory, dist_context.logger.warning)
    problem = broadcast(problem)
    if problem is not None:
        raise CheckpointDirectoryLockedError(problem)
    return CheckpointLock(directory / LOCK_FILE if holder is not None else None, holder)
