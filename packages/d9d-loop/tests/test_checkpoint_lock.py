"""One job per checkpoint directory: a second job is refused naming the holder; a dead lock is taken over."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from loop_toy_job import build_trainer, toy_config

from d9d.loop import CheckpointDirectoryLockedError
from d9d.mesh.testing import run_distributed

LOCK = ".d9d-lock"


def _config(directory: str, world_size: int = 1) -> Any:
    return toy_config(
        trainer={"max_steps": 2, "checkpoint": {"directory": directory, "every_steps": 1}},
        mesh={"data_parallel_shard": world_size},
    )


def _second_job_on_one_directory(directory: str) -> dict[str, Any]:
    """Two trainers on one directory in one process: the second is refused on every rank."""
    world = dist.get_world_size()
    first = build_trainer(_config(directory, world))
    lock: dict[str, Any] = json.loads((Path(directory) / LOCK).read_text())
    error = ""
    try:
        build_trainer(_config(directory, world))
    except CheckpointDirectoryLockedError as e:
        error = str(e)
    first.train()
    first.close()
    released = not (Path(directory) / LOCK).exists()
    again = build_trainer(_config(directory, world))  # the directory is free once the first closed
    again.close()
    first.dist_context.close()
    return {"error": error, "lock": lock, "released": released}


def test_a_second_job_on_one_directory_is_refused_on_every_rank_naming_the_holder(tmp_path: Path) -> None:
    # Two jobs on one folder used to run side by side: one died with ENOENT, its rerun resumed
    # from the other job's step.
    results = run_distributed(_second_job_on_one_directory, str(tmp_path), world_size=2)
    holder = results[0]["lock"]
    assert holder["host"] == socket.gethostname() and holder["pid"] > 0 and holder["since"]
    for result in results:  # every rank raises, none hangs
        error = result["error"]
        assert f"trainer.checkpoint.directory={tmp_path} is in use by another job" in error, error
        assert f"host {holder['host']}, pid {holder['pid']}, since {holder['since']}" in error
    assert results[0]["released"]  # the main rank holds the file and removes it on close


def _configure_over_a_lock(directory: str) -> dict[str, Any]:
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logging.getLogger("d9d").addHandler(handler)
    try:
        trainer = build_trainer(_config(directory))
    except CheckpointDirectoryLockedError as e:
        return {"error": str(e), "warnings": messages}
    finally:
        logging.getLogger("d9d").removeHandler(handler)
    holder: dict[str, Any] = json.loads((Path(directory) / LOCK).read_text())
    trainer.close()
    trainer.dist_context.close()
    return {"error": None, "warnings": messages, "holder": holder}


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize(
    ("lock", "taken_over"),
    [
        # a job of this host that was killed: its pid no longer runs
        ({"host": socket.gethostname(), "pid": _dead_pid(), "since": "2024-01-01T00:00:00+00:00"}, True),
        # its pid now belongs to another process (this one), started at another time
        ({"host": socket.gethostname(), "pid": os.getpid(), "process_start": "1", "since": "then"}, True),
        # another host: whether that job runs cannot be told from here
        ({"host": "gpu-node-7", "pid": 4242, "since": "2024-01-01T00:00:00+00:00"}, False),
    ],
)
def test_a_lock_left_by_a_killed_job(tmp_path: Path, lock: dict[str, Any], taken_over: bool) -> None:
    (tmp_path / LOCK).write_text(json.dumps(lock))
    result = run_distributed(_configure_over_a_lock, str(tmp_path), world_size=1)[0]
    held = f"host {lock['host']}, pid {lock['pid']}, since {lock['since']}"
    if taken_over:
        assert result["error"] is None, result["error"]
        warning = next(w for w in result["warnings"] if "taking over the lock" in w)
        assert f"a job that is gone ({held}, no longer running)" in warning
        assert result["holder"]["pid"] != lock["pid"] or result["holder"]["process_start"] != "1"
        assert not (tmp_path / LOCK).exists()  # released on close
    else:
        error = result["error"]
        assert error is not None and f"in use by another job ({held})" in error
        assert f"rm {tmp_path / LOCK}" in error
        assert json.loads((tmp_path / LOCK).read_text()) == lock  # left to its owner
