"""Activation checkpointing changes memory, never gradients: 1 rank, and 4 ranks under FSDP."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.mesh.testing import run_distributed
from d9d.parallel import FullCheckpointing, SelectiveCheckpointing, checkpoint_modules, parallelize_fsdp

POLICIES = {"full": FullCheckpointing(), "selective": SelectiveCheckpointing()}


def _count_forwards(block: nn.Module, calls: list[int]) -> None:
    """Counts calls of the block's first layer: the block's forward and its rerun in backward."""

    def count(module: nn.Module, args: object) -> None:
        calls.append(1)

    block[0].register_forward_pre_hook(count)


def _blocks() -> nn.Sequential:
    """Two Linear-Tanh blocks (the checkpointed units) and an output layer."""
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh()),
        nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
        nn.Linear(16, 6),
    )


def _check(harness, policy_name: str, with_fsdp: bool) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp_shard",))
    calls: list[int] = []

    def parallelize(model: nn.Module) -> None:
        names = checkpoint_modules(model, ["0", "1"], POLICIES[policy_name])
        assert names == ["0", "1"]
        _count_forwards(model[0], calls)
        if with_fsdp:
            for block in (model[0], model[1]):
                parallelize_fsdp(block, mesh=mesh)
            parallelize_fsdp(model, mesh=mesh)

    harness.ReferenceCheck(
        build=_blocks,
        parallelize=parallelize,
        make_batch=harness.regression_batch,
        loss_fn=harness.mse,
        shard_batch=lambda batch: tuple(t.chunk(world)[dist.get_rank()] for t in batch),
        microbatches=2,
        steps=2,
    ).run()
    # 2 steps x 2 microbatches: forward, then the rerun in backward
    assert len(calls) == 2 * 2 * 2


@pytest.mark.parametrize("policy_name", ["full", "selective"])
@pytest.mark.parametrize(
    ("world_size", "with_fsdp"),
    [
        (1, False),  # one process, plain parameters
        (4, True),  # FSDP over 4 ranks: parameters are gathered again for the rerun
    ],
)
def test_checkpointing_gives_the_gradients_of_no_checkpointing(
    harness, policy_name: str, world_size: int, with_fsdp: bool
) -> None:
    run_distributed(_check, harness, policy_name, with_fsdp, world_size=world_size, timeout_s=180)


def test_names_must_exist_and_a_module_is_checkpointed_once() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"\['7'\] are not submodules of Sequential"):
        checkpoint_modules(model, ["7"])
    assert checkpoint_modules(model, lambda name, m: isinstance(m, nn.Linear)) == ["0", "1"]
    assert list(model.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]  # names kept
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_modules(model, ["0"])
