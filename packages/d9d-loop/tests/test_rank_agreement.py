"""Ranks started with different settings refuse at start, on every rank, naming the field and the rank."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from recovery_helpers import run_toy

from d9d.loop import TrainerConfig
from d9d.loop.config._rank_agreement import describe_disagreement, flat_settings
from d9d.mesh import MeshParameters
from d9d.mesh.testing import run_distributed


def test_the_differing_fields_and_ranks_are_named() -> None:
    same = flat_settings({"trainer": TrainerConfig(max_steps=10, global_batch_size=8, microbatch_size=4)})
    other = flat_settings({"trainer": TrainerConfig(max_steps=12, global_batch_size=8, microbatch_size=4)})
    assert describe_disagreement([same, same, same]) is None
    problem = describe_disagreement([same, same, other, other])
    assert problem is not None
    assert "trainer.max_steps: rank 0 has 10, rank 2 has 12 (and 1 more ranks)" in problem


def test_nested_fields_are_named_by_their_path() -> None:
    mesh = flat_settings({"mesh": MeshParameters(data_parallel_shard=2)})
    other = flat_settings({"mesh": MeshParameters(data_parallel_replicate=2)})
    problem = describe_disagreement([mesh, other])
    assert problem is not None and "mesh.data_parallel_shard: rank 0 has 2, rank 1 has 1" in problem


def _configure_with_rank_dependent_steps() -> dict[str, Any]:
    # rank 1 read another config: 6 steps instead of 5
    return run_toy(None, max_steps=5 + dist.get_rank(), mesh={"data_parallel_shard": 2})


def test_a_job_whose_ranks_read_different_configs_refuses_before_training() -> None:
    for result in run_distributed(_configure_with_rank_dependent_steps, world_size=2, timeout_s=120):
        assert result["error"] is not None
        assert "trainer.max_steps: rank 0 has 5, rank 1 has 6" in result["error"]
        assert result["losses"] == []
