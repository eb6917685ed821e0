"""The named groups a training loop asks a DistributedContext for."""

import torch.distributed as dist

from d9d.mesh import BATCH_DOMAIN, DistributedContext, MeshParameters
from d9d.mesh.testing import run_distributed


def _named_groups() -> tuple[int, int, list[int], list[int], list[int]]:
    params = MeshParameters(pipeline_parallel=2, data_parallel_shard=2)
    ctx = DistributedContext(params, device_type="cpu")
    # computed without building a mesh, equal to the batch mesh's coordinate
    dp_rank = ctx.data_parallel_rank
    coordinate = ctx.mesh_for(BATCH_DOMAIN).get_coordinate()
    assert coordinate is not None
    stage = dist.get_process_group_ranks(ctx.stage_group())
    pipeline = dist.get_process_group_ranks(ctx.pipeline_group())
    world = dist.get_process_group_ranks(ctx.world_group())
    background = ctx.background_group()
    assert ctx.background_group() is background  # cached
    assert dist.get_backend(background) == "gloo"
    ctx.close()
    return dp_rank, coordinate[1], sorted(stage), sorted(pipeline), sorted(world)


def test_named_groups_follow_the_layout() -> None:
    results = run_distributed(_named_groups, world_size=4)
    for rank, (dp_rank, mesh_dp, stage, pipeline, world) in enumerate(results):
        assert dp_rank == mesh_dp == rank % 2
        assert stage == ([0, 1] if rank < 2 else [2, 3])
        assert pipeline == [rank % 2, rank % 2 + 2]
        assert world == [0, 1, 2, 3]
