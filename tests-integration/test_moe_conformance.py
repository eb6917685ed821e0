"""Conformance: d9d-kernels' real ``MoELayer`` with d9d-parallel's expert-parallel dispatcher.

``MoELayer.dispatcher`` is a slot typed by d9d-kernels' ``TokenDispatcher``;
``parallelize_expert_parallel`` installs d9d-parallel's ``AllToAllTokenDispatcher`` in it and
shards the experts. Each ep rank routes its own tokens; the reference is the same layer with its
local dispatcher over every rank's tokens in one process, its loss the mean of the ranks' losses
(what the default ``gradient_reduction="mean"`` averages). Outputs, input gradients and the
gradients of router, experts and shared expert must agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from d9d.kernels.layers import LocalTokenDispatcher, MoELayer, RouterScoreFunction
from d9d.mesh.testing import run_distributed
from d9d.parallel import AllToAllTokenDispatcher, GradientSynchronizer, parallelize_expert_parallel

TOKENS_PER_RANK, HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 12, 16, 4, 2, 24
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _conformance(score_function: RouterScoreFunction) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    reference = MoELayer(
        HIDDEN,
        EXPERTS,
        TOP_K,
        INTERMEDIATE,
        shared_expert_intermediate_size=INTERMEDIATE,
        score_function=score_function,
        init_std=0.3,
    )
    assert isinstance(reference.dispatcher, LocalTokenDispatcher)
    model = copy.deepcopy(reference)
    parallelize_expert_parallel(model, mesh=mesh)
    assert isinstance(model.dispatcher, AllToAllTokenDispatcher)
    synchronizer = GradientSynchronizer(model)

    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(world, TOKENS_PER_RANK, HIDDEN, generator=generator, requires_grad=True)
    upstream = torch.randn(world, TOKENS_PER_RANK, HIDDEN, generator=generator)
    expected = reference(hidden)
    ((expected * upstream).sum() / world).backward()
    assert hidden.grad is not None

    local = hidden[rank].detach().requires_grad_(True)
    synchronizer.begin_microbatch(is_last=True)
    output = model(local)
    (output * upstream[rank]).sum().backward()
    synchronizer.finish()
    synchronizer.close()

    torch.testing.assert_close(output, expected[rank].detach(), **TOLERANCE, msg=lambda m: f"output: {m}")
    # This rank's loss is world times its share of the reference's mean.
    assert local.grad is not None
    torch.testing.assert_close(local.grad, hidden.grad[rank] * world, **TOLERANCE)
    experts_seen: set[str] = set()
    for (name, parameter), ref_parameter in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        assert parameter.grad is not None and ref_parameter.grad is not None, name
        if name.startswith("experts."):
            experts_seen.add(name)
            assert isinstance(parameter, DTensor)
            assert parameter.to_local().shape[0] == EXPERTS // world, name
            # every expert got tokens, so each rank's shard is compared on real gradients
            assert bool((ref_parameter.grad.flatten(1).abs().sum(1) > 0).all()), name
        torch.testing.assert_close(
            _full(parameter.grad), ref_parameter.grad, **TOLERANCE, msg=lambda m, n=name: f"grad {n}: {m}"
        )
    assert experts_seen == {"experts.gate_proj", "experts.up_proj", "experts.down_proj"}


# (ep ranks, router score function)
CASES = [
    (2, "softmax"),  # 2 experts per rank
    (2, "sigmoid"),  # DeepSeek-V3 scores
    (4, "softmax"),  # 1 expert per rank
]


@pytest.mark.parametrize(("world", "score_function"), CASES)
def test_moe_layer_under_expert_parallelism_matches_local_dispatch(
    world: int, score_function: RouterScoreFunction
) -> None:
    run_distributed(_conformance, score_function, world_size=world, timeout_s=120)
