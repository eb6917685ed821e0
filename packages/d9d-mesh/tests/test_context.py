"""DistributedContext on CPU ranks (device forced to CPU: gloo ranks, also on a GPU host)."""

import gc
import math
import os
import subprocess
import sys
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from d9d.mesh import (
    ALL_DOMAINS,
    BATCH_DOMAIN,
    DENSE_DOMAIN,
    EXPERT_DOMAIN,
    FLAT_DOMAIN,
    REGULAR_DOMAIN,
    DistributedContext,
    MeshDomain,
    MeshParameters,
)
from d9d.mesh.testing import run_distributed


def _coords(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def _expected_group(rank: int, shape: tuple[int, ...], dim: int) -> list[int]:
    """Ranks that share all coordinates with ``rank`` except along ``dim`` (row-major layout)."""
    mine = _coords(rank, shape)
    world = math.prod(shape)
    return [
        r
        for r in range(world)
        if all(c == m for i, (c, m) in enumerate(zip(_coords(r, shape), mine, strict=True)) if i != dim)
    ]


def _sizes(p: MeshParameters) -> dict[MeshDomain, dict[str, int]]:
    return {
        REGULAR_DOMAIN: {
            "pp": p.pipeline_parallel,
            "dp_replicate": p.data_parallel_replicate,
            "dp_shard": p.data_parallel_shard,
            "cp_shard": p.context_parallel_shard,
            "cp_replicate": p.context_parallel_replicate,
            "tp": p.tensor_parallel,
        },
        DENSE_DOMAIN: {
            "pp": p.pipeline_parallel,
            "dp_replicate": p.data_parallel_replicate,
            "dp_cp_shard": p.data_parallel_shard * p.context_parallel_shard,
            "cp_replicate": p.context_parallel_replicate,
            "tp": p.tensor_parallel,
        },
        EXPERT_DOMAIN: {
            "pp": p.pipeline_parallel,
            "ep_replicate": p.ranks_per_stage // p.expert_parallel,
            "ep_shard": p.expert_parallel,
        },
        BATCH_DOMAIN: {
            "pp": p.pipeline_parallel,
            "dp": p.data_parallel,
            "cp": p.context_parallel,
            "tp": p.tensor_parallel,
        },
        FLAT_DOMAIN: {"world": p.world_size},
    }


def _check_all_domains(fields: dict[str, int]) -> None:
    params = MeshParameters(**fields)
    ctx = DistributedContext(params, device_type="cpu")
    assert ctx.device == torch.device("cpu") and ctx.backend == "gloo"
    rank = dist.get_rank()
    for domain in ALL_DOMAINS:
        mesh = ctx.mesh_for(domain)
        expected = _sizes(params)[domain]
        assert mesh.mesh_dim_names == tuple(expected), (domain, mesh.mesh_dim_names)
        assert tuple(mesh.shape) == tuple(expected.values()), (domain, mesh.shape)
        shape = tuple(expected.values())
        for dim, name in enumerate(expected):
            group = mesh.get_group(name)
            members = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
            dist.all_gather(members, torch.tensor([rank]), group=group)
            got = sorted(int(m.item()) for m in members)
            assert got == _expected_group(rank, shape, dim), (domain, name, got)
    assert ctx.mesh_for(DENSE_DOMAIN) is ctx.mesh_for(DENSE_DOMAIN)
    ctx.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"data_parallel_shard": 4},
        {"data_parallel_replicate": 2, "data_parallel_shard": 2},
        {"pipeline_parallel": 2, "data_parallel_shard": 2},
        {"tensor_parallel": 2, "data_parallel_shard": 2},
        {"context_parallel_shard": 2, "data_parallel_shard": 2},
        {"context_parallel_replicate": 2, "data_parallel_shard": 2},
        {"data_parallel_shard": 4, "expert_parallel": 2},
        # ep=4: experts over all 4 ranks of the (only) stage, which are data-parallel for dense parts
        {"data_parallel_shard": 4, "expert_parallel": 4},
    ],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()),
)
def test_domains_on_four_ranks(fields: dict[str, int]) -> None:
    run_distributed(_check_all_domains, fields, world_size=4)


def _hand_checked_hsdp_groups() -> None:
    ctx = DistributedContext(
        MeshParameters(data_parallel_replicate=2, data_parallel_shard=2), device_type="cpu"
    )
    dense = ctx.mesh_for(DENSE_DOMAIN)
    rank = dist.get_rank()
    replicate = dist.get_process_group_ranks(dense.get_group("dp_replicate"))
    shard = dist.get_process_group_ranks(dense.get_group("dp_cp_shard"))
    assert sorted(replicate) == {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}[rank]
    assert sorted(shard) == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}[rank]
    assert ctx.data_parallel_rank == rank
    ctx.close()


def test_hsdp_groups_by_hand() -> None:
    run_distributed(_hand_checked_hsdp_groups, world_size=4)


def _pipeline_and_seed() -> tuple[int, int, float]:
    ctx = DistributedContext(MeshParameters(pipeline_parallel=2, tensor_parallel=2), device_type="cpu")
    used = ctx.seed(7)
    return ctx.pipeline_rank, used, torch.rand(1).item()


def test_seed_is_shared_within_a_stage_and_differs_across_stages() -> None:
    results = run_distributed(_pipeline_and_seed, world_size=4)
    assert [r[0] for r in results] == [0, 0, 1, 1]
    assert results[0][2] == results[1][2]
    assert results[2][2] == results[3][2]
    assert results[0][2] != results[2][2]


def _wrong_world() -> None:
    with pytest.raises(ValueError, match=r"mesh needs 4 ranks .* world size is 2"):
        DistributedContext(MeshParameters(data_parallel_shard=4), device_type="cpu")


def test_world_size_mismatch_raises() -> None:
    run_distributed(_wrong_world, world_size=2)


def _main_first_and_timeout() -> None:
    ctx = DistributedContext(MeshParameters(data_parallel_shard=2), device_type="cpu")
    order: list[str] = []
    with ctx.main_process_first():
        order.append("body")
    assert ctx.is_main_process == (dist.get_rank() == 0)
    ctx.mesh_for(FLAT_DOMAIN)
    ctx.set_timeout(timedelta(seconds=1))
    assert ctx.timeout == timedelta(seconds=1)
    if dist.get_rank() == 0:
        # rank 1 never joins: the collective must fail after the timeout instead of hanging
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1), group=ctx.mesh_for(FLAT_DOMAIN).get_group("world"))


def test_main_process_first_and_timeout() -> None:
    run_distributed(_main_first_and_timeout, world_size=2, timeout_s=60)


def test_world_of_one_without_torchrun() -> None:
    assert not dist.is_initialized()
    ctx = DistributedContext(MeshParameters(), device_type="cpu")
    try:
        assert ctx.world_size == 1 and ctx.rank == 0 and ctx.is_main_process
        for domain in ALL_DOMAINS:
            assert math.prod(ctx.mesh_for(domain).shape) == 1
        t = torch.ones(2)
        dist.all_reduce(t)
        torch.testing.assert_close(t, torch.ones(2))
    finally:
        ctx.close()
    assert not dist.is_initialized()


def test_close_lets_go_of_every_process_group() -> None:
    # a group still referenced after destroy_process_group lives on until interpreter exit
    ctx = DistributedContext(MeshParameters(), device_type="cpu")
    groups = [weakref.ref(ctx.background_group()), weakref.ref(ctx.stage_group())]
    for domain in ALL_DOMAINS:
        ctx.mesh_for(domain)
    ctx.close()
    gc.collect()
    assert [group() for group in groups] == [None, None]


def test_close_frees_the_groups_of_meshes_dtensors_ran_on() -> None:
    # torch's DTensor caches keep every mesh a DTensor ran on, and a mesh its groups: a group alive
    # when the interpreter finalizes keeps gloo worker threads that can abort the process there
    ctx = DistributedContext(MeshParameters(), device_type="cpu")
    group = ctx.background_group()  # a group of its own, as parallelize_hsdp builds meshes from
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp",))
    x = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    doubled = (x * 2).redistribute(mesh, [Replicate()]).full_tensor()
    torch.testing.assert_close(doubled, torch.full((4, 2), 2.0))
    freed = weakref.ref(group)
    del group, mesh, x
    ctx.close()
    gc.collect()
    assert freed() is None


def test_world_of_one_rejects_bigger_mesh_before_starting_groups() -> None:
    with pytest.raises(ValueError, match="world size is 1"):
        DistributedContext(MeshParameters(tensor_parallel=2), device_type="cpu")
    assert not dist.is_initialized()


def _count_created_groups() -> int:
    ctx = DistributedContext(MeshParameters(pipeline_parallel=2, data_parallel_shard=2), device_type="cpu")
    for domain in ALL_DOMAINS:
        ctx.mesh_for(domain)
    created = ctx.process_groups_created
    ctx.close()
    return created


def test_domains_share_process_groups() -> None:
    # 18 mesh dims over five domains split 4 ranks only 4 ways: by pp ({0,2},{1,3}), by data
    # ({0,1},{2,3}), into singletons (every size-1 dim) and all together (the default group).
    assert run_distributed(_count_created_groups, world_size=4) == [3, 3, 3, 3]


_TWO_CONTEXTS_THEN_RAISE = """
from d9d.mesh import DistributedContext, MeshParameters
DistributedContext(MeshParameters(), device_type="cpu").close()
DistributedContext(MeshParameters(), device_type="cpu")
raise ValueError("the error")
"""


def test_an_error_after_a_second_one_process_context_is_printed_without_rank_prefixes() -> None:
    # each process group torch starts wrapped the excepthook again: "[rank0]: [rank0]: ValueError"
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    done = subprocess.run(
        [sys.executable, "-c", _TWO_CONTEXTS_THEN_RAISE], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == "ValueError: the error", done.stderr[-500:]
