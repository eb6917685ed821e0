import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from d9d.mesh import DENSE_DOMAIN, DistributedContext, MeshParameters
from d9d.mesh.testing import run_distributed
from d9d.parallel import hsdp_mesh, parallelize_fsdp, parallelize_hsdp, prefetch_fsdp_units


def _per_rank_rows(world: int):
    return lambda batch: tuple(t.chunk(world)[dist.get_rank()] for t in batch)


def _fsdp(harness, microbatches: int) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp_shard",))

    def parallelize(model: nn.Module) -> None:
        for layer in model:
            if isinstance(layer, nn.Linear):
                parallelize_fsdp(layer, mesh=mesh)
        parallelize_fsdp(model, mesh=mesh)
        for p in model.parameters():
            assert isinstance(p, DTensor) and p.placements == (Shard(0),)

    harness.ReferenceCheck(
        build=harness.mlp,
        parallelize=parallelize,
        make_batch=harness.regression_batch,
        loss_fn=harness.mse,
        shard_batch=_per_rank_rows(world),
        microbatches=microbatches,
    ).run()


def test_fsdp_matches_single_process(harness) -> None:
    # 4 shards (the 6-row output layer is uneven), 2 microbatches of accumulation
    run_distributed(_fsdp, harness, 2, world_size=4, timeout_s=180)


def _hsdp(harness, parameters: MeshParameters, microbatches: int) -> None:
    context = DistributedContext(parameters, device_type="cpu")
    mesh = context.mesh_for(DENSE_DOMAIN)["dp_replicate", "dp_cp_shard", "cp_replicate"]
    world = dist.get_world_size()

    def parallelize(model: nn.Module) -> None:
        parallelize_hsdp(model, mesh=mesh)
        if world == 1:  # nothing to shard: parameters stay plain tensors
            assert not any(isinstance(p, DTensor) for p in model.parameters())
            return
        for p in model.parameters():
            assert isinstance(p, DTensor) and p.placements == (Replicate(), Shard(0))
            replicas = parameters.data_parallel_replicate * parameters.context_parallel_replicate
            assert p.device_mesh.shape == (replicas, parameters.data_parallel_shard)

    harness.ReferenceCheck(
        build=harness.mlp,
        parallelize=parallelize,
        make_batch=harness.regression_batch,
        loss_fn=harness.mse,
        shard_batch=_per_rank_rows(world),
        microbatches=microbatches,
    ).run()


@pytest.mark.parametrize(
    ("parameters", "microbatches"),
    [
        # 2 replicas x 2 shards, gradient accumulation over 2 microbatches
        (MeshParameters(data_parallel_replicate=2, data_parallel_shard=2), 2),
        # the quickstart's 3-D call with two replicate dims of 2 (folded into one of 4)
        (MeshParameters(data_parallel_replicate=2, context_parallel_replicate=2), 1),
        # the quickstart's 3-D call with replicas, shards and a size-1 cp_replicate
        (MeshParameters(data_parallel_replicate=2, data_parallel_shard=2, context_parallel_replicate=1), 1),
    ],
)
def test_hsdp_matches_single_process(harness, parameters, microbatches) -> None:
    run_distributed(_hsdp, harness, parameters, microbatches, world_size=parameters.world_size, timeout_s=180)


def test_hsdp_quickstart_call_on_a_world_of_one(harness) -> None:
    # every size 1: the same provider code runs in one process
    run_distributed(_hsdp, harness, MeshParameters(), 2, world_size=1, timeout_s=120)


def _bad_input() -> None:
    flat = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("dp",))
    square = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    with pytest.raises(ValueError, match=r"ends in 'shard'.*\('dp',\)"):
        parallelize_hsdp(nn.Linear(2, 2), mesh=flat)
    with pytest.raises(ValueError, match=r"1-D mesh.*\('dp_replicate', 'dp_shard'\)"):
        parallelize_fsdp(nn.Linear(2, 2), mesh=square)
    with pytest.raises(ValueError, match="ReLU has no parameters"):
        parallelize_fsdp(nn.ReLU(), mesh=flat)
    # an already 2-D (replicate, shard) mesh is used as it is
    assert hsdp_mesh(square) is square


def test_bad_meshes_and_modules_are_named() -> None:
    run_distributed(_bad_input, world_size=4, timeout_s=120)


def _mixed_precision() -> None:
    mesh = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    reference = nn.Linear(8, 4)
    model = nn.Linear(8, 4)
    model.load_state_dict(reference.state_dict())
    parallelize_fsdp(model, mesh=mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    seen: list[torch.dtype] = []
    model.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = model(x)
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    # Sharded parameters and their gradients stay fp32; the result is close to fp32 maths.
    assert model.weight.dtype == torch.float32 and model.weight.grad.dtype == torch.float32
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    (sum(reference(xr).square().mean() for xr in xs) / 2).backward()
    torch.testing.assert_close(model.weight.grad.full_tensor(), reference.weight.grad, atol=2e-2, rtol=2e-2)


def test_fsdp_mixed_precision_computes_in_bf16_and_keeps_fp32_shards() -> None:
    run_distributed(_mixed_precision, world_size=2, timeout_s=120)


def _fsdp_with_prefetch(harness, forward: int, backward: int) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp_shard",))
    gathers: list[int] = []

    def parallelize(model: nn.Module) -> None:
        units = [layer for layer in model if isinstance(layer, nn.Linear)]
        for unit in units:
            parallelize_fsdp(unit, mesh=mesh)
        parallelize_fsdp(model, mesh=mesh)
        assert prefetch_fsdp_units([*units, nn.ReLU()], forward=forward, backward=backward) == units
        for index, unit in enumerate(units):
            unit.register_forward_pre_hook(lambda *_, i=index: gathers.append(i))

    harness.ReferenceCheck(
        build=lambda: harness.mlp((8, 16, 16, 16, 6)),  # four units
        parallelize=parallelize,
        make_batch=harness.regression_batch,
        loss_fn=harness.mse,
        shard_batch=_per_rank_rows(world),
        microbatches=2,
    ).run()
    assert gathers  # the units ran (prefetching changes when gathers start, not the results)


@pytest.mark.parametrize(("forward", "backward"), [(1, 1), (2, 3)])
def test_fsdp_with_explicit_prefetch_matches_single_process(harness, forward: int, backward: int) -> None:
    run_distributed(_fsdp_with_prefetch, harness, forward, backward, world_size=2, timeout_s=180)


def test_prefetch_counts_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="forward=-1"):
        prefetch_fsdp_units([], forward=-1)
