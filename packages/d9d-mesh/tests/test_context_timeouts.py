"""The configured collective timeout applies to a process group that existed before the context."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from d9d.mesh import FLAT_DOMAIN, DistributedContext, MeshParameters
from d9d.mesh.testing import run_distributed


def _existing_group_obeys_the_timeout(done: str) -> None:
    # run_distributed made the default group (its own, long timeout) before the context exists
    ctx = DistributedContext(
        MeshParameters(data_parallel_shard=2), device_type="cpu", timeout=timedelta(seconds=3)
    )
    world = ctx.mesh_for(FLAT_DOMAIN).get_group("world")
    if dist.get_rank() == 1:
        # never joins; stays alive until rank 0 is done (however slow the machine), so rank 0
        # cannot fail by a closed connection instead of the timeout
        while not Path(done).exists():
            time.sleep(0.05)
        return
    try:
        for group in (None, world):  # the default group, and the world dim d9d's loop reduces the loss on
            with pytest.raises(RuntimeError, match=r"(?i)timed out|timeout"):
                dist.all_reduce(torch.ones(1), group=group)
    finally:
        Path(done).touch()


def test_collective_timeout_applies_to_an_existing_group(tmp_path: Path) -> None:
    run_distributed(_existing_group_obeys_the_timeout, str(tmp_path / "done"), world_size=2, timeout_s=120)
