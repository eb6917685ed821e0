"""Unusable output directories are refused when the job is configured, not at the first save."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from recovery_helpers import run_toy

from d9d.loop.checkpoint._directory_checks import (
    DirectoryCheckError,
    DiskUsage,
    check_output_directory,
    describe_write_failure,
)
from d9d.mesh.testing import run_distributed


def test_a_checkpoint_directory_under_a_regular_file_is_refused_at_configure_time(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    result = run_distributed(run_toy, str(tmp_path / "file" / "ckpt"), max_steps=2, world_size=1)[0]
    error = result["error"] or ""
    # every rank raises the main rank's error with its own errno (was "[Errno 5] [Errno 20] ...")
    assert error.startswith("DirectoryCheckError: [Errno 20] trainer.checkpoint.directory="), error
    assert f"trainer.checkpoint.directory={tmp_path / 'file' / 'ckpt'} cannot be created: ENOTDIR" in error
    assert result["losses"] == []  # refused before the first step


def test_a_checkpoint_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("a file")
    with pytest.raises(DirectoryCheckError, match="exists and is not a directory"):
        check_output_directory(tmp_path / "ckpt", what="trainer.checkpoint.directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        with pytest.raises(DirectoryCheckError, match=r"ro is not writable: EACCES"):
            check_output_directory(read_only, what="trainer.checkpoint.directory")
    finally:
        read_only.chmod(0o700)


def test_a_failed_probe_is_reported_even_when_removing_the_probe_fails_too(tmp_path: Path) -> None:
    # On a read-only mount the cleanup's unlink raised EROFS about .d9d-write-probe-N and hid the
    # DirectoryCheckError; a directory standing where the probe goes fails both the same way, as root.
    (tmp_path / f".d9d-write-probe-{os.getpid()}").mkdir()
    with pytest.raises(DirectoryCheckError, match=r"is not writable: EISDIR"):
        check_output_directory(tmp_path, what="trainer.checkpoint.directory")


def test_a_directory_without_room_for_one_checkpoint_is_refused(tmp_path: Path) -> None:
    def nearly_full(path: Path) -> DiskUsage:
        del path
        return DiskUsage(total=100 << 20, used=99 << 20, free=1 << 20)

    with pytest.raises(
        DirectoryCheckError, match=r"has 1.0 MiB free; one checkpoint needs about 8.0 MiB"
    ) as e:
        check_output_directory(
            tmp_path, what="trainer.checkpoint.directory", required_bytes=8 << 20, disk_usage=nearly_full
        )
    assert e.value.errno == errno.ENOSPC


def test_a_write_failure_names_the_path_and_the_os_error(tmp_path: Path) -> None:
    # what DCP raises on a full disk wraps the OSError; the message used to be "unexpected pos"
    cause = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "__0_0.distcp"))
    try:
        try:
            raise cause
        except OSError as inner:
            raise RuntimeError("unexpected pos 704 vs 598") from inner
    except RuntimeError as outer:
        message = describe_write_failure(tmp_path / "step_000000001.partial", outer)
    assert message.startswith(f"writing {tmp_path / 'step_000000001.partial'} failed: ENOSPC")
    assert "__0_0.distcp" in message and "MiB free" in message
