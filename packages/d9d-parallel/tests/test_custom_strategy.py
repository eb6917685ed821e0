import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from d9d.mesh.testing import run_distributed
from d9d.parallel import LocalParameterSlot, install_local_forward, parallelize_replicate


def parallelize_column_sharded(linear: nn.Linear, mesh: DeviceMesh) -> None:
    """A user's strategy: the weight is stored Shard(1) (its input columns split over the
    data-parallel ranks), gathered whole for forward; its gradient is averaged and
    reduce-scattered back by DTensor autograd. The bias is plainly replicated."""
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(1)]))
    install_local_forward(
        linear,
        [LocalParameterSlot(owner=linear, name="weight", grad_placements=(Partial("avg"),), gather=True)],
    )
    if linear.bias is not None:
        parallelize_replicate(linear, mesh=mesh)  # the weight is a DTensor already: only the bias


def _custom(harness) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp",))

    def parallelize(model: nn.Module) -> None:
        parallelize_column_sharded(model[0], mesh)
        parallelize_replicate(model, mesh=mesh)  # the rest; DTensors already placed stay
        assert model[0].weight.placements == (Shard(1),)
        assert model[0].bias.placements == (Replicate(),)
        assert model[2].weight.placements == (Replicate(),)

    norms = harness.ReferenceCheck(
        build=lambda: harness.mlp((8, 16, 6)),
        parallelize=parallelize,
        make_batch=harness.regression_batch,
        loss_fn=harness.mse,
        shard_batch=lambda batch: tuple(t.chunk(world)[dist.get_rank()] for t in batch),
        microbatches=2,
    ).run()
    assert len(norms) == 3


def test_user_strategy_with_a_shard_1_parameter_matches_single_process(harness) -> None:
    # 4 ranks; the Shard(1) weight's gradient is complete after backward (the synchronizer
    # leaves it), the others are all-reduced; clipping sums the Shard(1) pieces once each.
    run_distributed(_custom, harness, world_size=4, timeout_s=180)


def _shard_1_grad_is_not_reduced_again() -> None:
    mesh = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("dp",))
    linear = nn.Linear(4, 2, bias=False)
    parallelize_column_sharded(linear, mesh)
    linear(torch.ones(1, 4) * (dist.get_rank() + 1)).sum().backward()
    assert isinstance(linear.weight.grad, DTensor) and linear.weight.grad.placements == (Shard(1),)
    torch.testing.assert_close(linear.weight.grad.full_tensor(), torch.full((2, 4), 1.5))


def test_shard_1_gradient_is_averaged_by_autograd() -> None:
    run_distributed(_shard_1_grad_is_not_reduced_again, world_size=2, timeout_s=120)
