import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from d9d.mesh.testing import run_distributed
from d9d.parallel import GradientSynchronizer, parallelize_replicate


def _deep_mlp() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])


def _overlap_and_equality(bucket_size_mb: float, expect_early_launch: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    plain = _deep_mlp()
    model = copy.deepcopy(plain)
    parallelize_replicate(model, mesh=mesh)
    sync = GradientSynchronizer(model, bucket_size_mb=bucket_size_mb)
    assert sync.num_hooked_parameters == 8

    # Hooks registered after the synchronizer's see its state right after each gradient lands.
    params = list(model.parameters())
    # Entry i: (buckets launched, gradients of this backward still to come) at the i-th gradient.
    observed: list[tuple[int, int]] = []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _p: observed.append((sync.launched_buckets, len(params) - len(observed) - 1))
        )

    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
    sync.begin_microbatch(is_last=False)
    model(x).square().mean().backward()
    assert sync.launched_buckets == 0, "no reduction before the last microbatch"
    observed.clear()
    sync.begin_microbatch(is_last=True)
    model(x).square().mean().backward()
    launched_at_end = sync.launched_buckets
    assert sync.in_flight_buckets == launched_at_end, "backward only launches; finish() waits"
    sync.finish()

    if expect_early_launch:
        # A bucket went out while later gradients (earlier layers) were still to be computed.
        assert observed[0] == (1, 7), observed
        assert sync.in_flight_buckets == 0
        assert launched_at_end == 8
    else:
        # One bucket, launched by the hook of the last gradient (still inside backward).
        assert observed[-2] == (0, 1)
        assert observed[-1] == (1, 0)
        assert launched_at_end == 1

    # Equals a plain all-reduce (mean) of the single-process gradients of both microbatches.
    (plain(x).square().mean() * 2).backward()
    for (name, expected), p in zip(plain.named_parameters(), params, strict=True):
        reduced = expected.grad.clone()
        dist.all_reduce(reduced)
        assert isinstance(p.grad, DTensor) and p.grad.placements == (Replicate(),)
        torch.testing.assert_close(p.grad.to_local(), reduced / world, atol=1e-6, rtol=1e-5, msg=name)
    sync.close()


@pytest.mark.parametrize(
    ("bucket_size_mb", "expect_early_launch"),
    [
        (1e-6, True),  # every gradient fills a bucket: launched during backward, one by one
        (100.0, False),  # one bucket for all: launched when its last gradient arrives
    ],
)
def test_buckets_overlap_backward_and_match_all_reduce(bucket_size_mb, expect_early_launch) -> None:
    run_distributed(_overlap_and_equality, bucket_size_mb, expect_early_launch, world_size=2, timeout_s=120)


def _sum_reduction() -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp",))
    model = nn.Linear(3, 1)
    parallelize_replicate(model, mesh=mesh, gradient_reduction="sum")
    sync = GradientSynchronizer(model)
    model(torch.ones(1, 3)).sum().backward()
    sync.finish()
    torch.testing.assert_close(model.weight.grad.to_local(), torch.full((1, 3), float(world)))


def test_sum_reduction_adds_replica_gradients() -> None:
    run_distributed(_sum_reduction, world_size=2, timeout_s=120)


def test_bucket_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_size_mb"):
        GradientSynchronizer(nn.Linear(1, 1), bucket_size_mb=0)


def _dtypes_get_their_own_buckets() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp",))
    first, second = nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16)
    parallelize_replicate(first, mesh=mesh)
    parallelize_replicate(second, mesh=mesh)
    model = nn.ModuleList([first, second])
    sync = GradientSynchronizer(model, bucket_size_mb=100.0)
    x = torch.full((1, 4), float(rank + 1))
    second(first(x).to(torch.bfloat16)).float().sum().backward()
    assert sync.launched_buckets == 2  # one fp32 and one bf16 bucket
    own = [p.grad.to_local().clone() for p in model.parameters()]
    sync.finish()
    for p, mine in zip(model.parameters(), own, strict=True):
        expected = mine.float()
        dist.all_reduce(expected)
        assert p.grad.dtype == p.dtype
        torch.testing.assert_close(p.grad.to_local().float(), expected / world, atol=1e-2, rtol=1e-2)


def test_each_dtype_is_reduced_in_its_own_bucket() -> None:
    run_distributed(_dtypes_get_their_own_buckets, world_size=2, timeout_s=120)
