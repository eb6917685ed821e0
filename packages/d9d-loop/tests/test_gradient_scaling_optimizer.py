"""An optimizer that applies the clipping factor itself trains exactly as clipping in place."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from loop_toy_job import assert_same_run, toy_config, train_and_record

from d9d.loop import GradientScalingOptimizer, OptimizerProviderContext
from d9d.mesh.testing import run_distributed

kernels = pytest.importorskip("d9d.kernels")


class _ClipsInPlace(kernels.StochasticAdamW):
    # Not a GradientScalingOptimizer (a None member fails the protocol check): the trainer
    # multiplies the gradients before an ordinary step.
    step_with_gradient_scale = None


class _Provider:
    def __init__(self, fused: bool) -> None:
        self._fused = fused

    def build(self, context: OptimizerProviderContext) -> torch.optim.Optimizer:
        params = [p for stage in context.model_stages for p in stage.parameters()]
        optimizer_class = kernels.StochasticAdamW if self._fused else _ClipsInPlace
        optimizer = optimizer_class(params, lr=0.01, weight_decay=0.1)
        assert isinstance(optimizer, GradientScalingOptimizer) is self._fused
        return optimizer


def _train(mesh: dict[str, int], fused: bool) -> dict[str, Any]:
    # clipping at 0.05 is active on every step; weighted microbatches add a loss-weight scale
    config = toy_config(mesh=mesh, trainer={"gradient_clipping": {"max_norm": 0.05}, "max_steps": 4})
    return train_and_record(config, strategy="fsdp", weighted=True, optimizer_provider=_Provider(fused))


def test_the_factor_in_the_step_equals_clipping_in_place() -> None:
    fused, in_place = (run_distributed(_train, {}, f, world_size=1)[0] for f in (True, False))
    assert fused["losses"] == in_place["losses"]
    assert fused["norms"] == in_place["norms"]
    assert max(fused["norms"]) > 0.05, "clipping must be active for the comparison to mean anything"
    for name, value in in_place["params"].items():
        assert torch.equal(fused["params"][name], value), name


def test_the_factor_in_the_step_under_fsdp_matches_one_process() -> None:
    reference = run_distributed(_train, {}, True, world_size=1)[0]
    for result in run_distributed(_train, {"data_parallel_shard": 2}, True, world_size=2, timeout_s=120):
        assert_same_run(result, reference)
