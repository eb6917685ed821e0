import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from d9d.mesh.testing import run_distributed
from d9d.parallel import parallelize_replicate


def _replicate_matches_reference(harness, mesh_shape: tuple[int, ...], microbatches: int) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh(
        "cpu", torch.arange(world).reshape(mesh_shape), mesh_dim_names=("a", "b")[: len(mesh_shape)]
    )
    seen_in_forward: list[type] = []

    def parallelize(model: nn.Module) -> None:
        parallelize_replicate(model, mesh=mesh)
        for p in model.parameters():
            assert isinstance(p, DTensor) and p.placements == (Replicate(),) * len(mesh_shape)
        model[0].register_forward_pre_hook(lambda m, _: seen_in_forward.append(type(m.weight)))

    check = harness.ReferenceCheck(
        build=harness.mlp,
        parallelize=parallelize,
        make_batch=harness.regression_batch,
        loss_fn=harness.mse,
        shard_batch=lambda batch: tuple(t.chunk(world)[dist.get_rank()] for t in batch),
        microbatches=microbatches,
    )
    check.run()
    # The forward saw plain tensors, not DTensors.
    assert seen_in_forward and all(t is torch.Tensor for t in seen_in_forward)


@pytest.mark.parametrize(
    ("mesh_shape", "microbatches"),
    [
        ((4,), 2),  # 4 replicas, gradient accumulation over 2 microbatches
        ((2, 2), 1),  # replicas over a 2-D mesh: reduced over both dims
    ],
)
def test_replicate_matches_single_process(harness, mesh_shape, microbatches) -> None:
    run_distributed(
        _replicate_matches_reference, harness, mesh_shape, microbatches, world_size=4, timeout_s=180
    )


def _tied_and_errors() -> None:
    mesh = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("dp",))
    embed = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    parallelize_replicate(model, mesh=mesh)
    assert model["embed"].weight is model["head"].weight
    with pytest.raises(ValueError, match="Tanh has no parameters"):
        parallelize_replicate(nn.Tanh(), mesh=mesh)
    with pytest.raises(ValueError, match="already a DTensor"):
        parallelize_replicate(model, mesh=mesh)


def test_tied_parameters_stay_tied_and_bad_input_is_named() -> None:
    run_distributed(_tied_and_errors, world_size=2, timeout_s=120)
