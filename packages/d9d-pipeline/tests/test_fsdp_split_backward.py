"""Split-backward schedules on FSDP and HSDP stages match one process on the whole batch.

pipeline 2 x data_parallel_shard 2 on 4 CPU ranks (and HSDP: pipeline 2 x replicate 2 x shard 2
on 8): losses, reduced gradients and parameters after several SGD steps equal a single-process
reference whose gradient is the mean over the data-parallel parts of the batch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from d9d.mesh.testing import run_distributed
from d9d.pipeline import (
    DualPipeVScheduleConfig,
    InterleavedZeroBubbleScheduleConfig,
    PipelineExecutor,
    PipelineScheduleConfig,
    ZBVScheduleConfig,
    build_program,
)
from d9d.pipeline import _sharded_backward as sharded_backward
from d9d.pipeline._stage_runtime import StageRuntime

from ._pipeline_model import Stage, build_stages, make_batch, make_loss_fn, reference

NUM_LAYERS = 8
MICROBATCHES = 4  # DualPipeV needs 2 x ranks
STEPS = 3
ROWS_PER_RANK = 8  # each data-parallel rank trains on its part of the batch


class _ShardedStage(nn.Module):
    """A stage whose layers and root are ``fully_shard``-ed; output shapes come from a meta copy."""

    def __init__(self, stage: Stage, mesh: DeviceMesh) -> None:
        super().__init__()
        self._meta = [copy.deepcopy(stage).to("meta")]  # a list: not a submodule
        for layer in stage.layers:
            fully_shard(layer, mesh=mesh)  # reshard_after_forward: W must gather them again
        fully_shard(stage, mesh=mesh)
        self.stage = stage

    def forward(self, inputs: Any, shared: Any) -> Any:
        return self.stage(inputs, shared)

    def set_overlap_point(self, point: Any) -> None:
        self.stage.set_overlap_point(point)  # overlapped pairs take turns after each layer

    def pipeline_output_meta(self, inputs: Any, shared: Any) -> Any:
        return self._meta[0](inputs, shared)


def _part(tree: dict[str, torch.Tensor], index: int, parts: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(parts)[index] for k, v in tree.items()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _sync_on_last(stages: dict[int, _ShardedStage]) -> Any:
    """A weight-gradient hook as a gradient synchronizer's: FSDP reduces only in the last one."""

    def hook(stage: int, microbatch: int, is_last: bool) -> None:
        del microbatch
        for module in stages[stage].modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(is_last, recurse=False)

    return hook


def _train_without_manual_finalization(config: PipelineScheduleConfig) -> int:
    """As on a torch whose FSDP cannot finalize on request: the backward runs whole in ``I``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sharded_backward, "manual_finalization_available", lambda: False)
        return _train(config, False, whole_backward=True)


def _train(config: PipelineScheduleConfig, hsdp: bool, *, whole_backward: bool = False) -> int:
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        dp_rank = mesh.get_local_rank("dp_replicate") * 2 + mesh.get_local_rank("dp_shard")
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
        dp_mesh, dp_rank = mesh["dp_shard"], mesh.get_local_rank("dp_shard")
    pp_rank, dp = mesh.get_local_rank("pp"), dp_mesh.size()
    program = build_program(config, num_ranks=2, num_microbatches=MICROBATCHES)
    stages = build_stages(program.num_stages, NUM_LAYERS)
    ref_stages = copy.deepcopy(stages)
    mine = {s: _ShardedStage(stages[s], dp_mesh) for s in program.stages_of(pp_rank)}
    if whole_backward:
        with pytest.warns(UserWarning, match=r"lacks FSDPModule.finalize_backward"):
            executor = PipelineExecutor(program, mine, group=mesh.get_group("pp"))
    else:
        executor = PipelineExecutor(program, mine, group=mesh.get_group("pp"))
    optimizer = torch.optim.SGD([p for m in mine.values() for p in m.parameters()], lr=0.01)
    ref_optimizer = torch.optim.SGD([p for s in ref_stages for p in s.parameters()], lr=0.01)
    checked = 0
    for step in range(STEPS):
        inputs, shared, target = make_batch(ROWS_PER_RANK * dp, seed=step)
        parts = [(_part(inputs, d, dp), target.chunk(dp)[d]) for d in range(dp)]
        optimizer.zero_grad()
        local_inputs, local_target = parts[dp_rank]
        losses = executor.step(
            local_inputs,
            loss_fn=make_loss_fn(local_target, MICROBATCHES),
            shared=shared,
            weight_gradient_hook=_sync_on_last(mine),
        )
        # the reference: one process, the gradient of the mean of the parts' losses
        ref_runs = [reference(ref_stages, x, shared, t, MICROBATCHES) for x, t in parts]
        if executor.has_last_stage:
            assert losses is not None
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_runs[dp_rank][0]))
        for s, module in mine.items():
            runs = [run[1][s].parameters() for run in ref_runs]
            for param, *ref_params in zip(module.stage.parameters(), *runs, strict=True):
                want = sum(p.grad for p in ref_params) / dp
                assert param.grad is not None
                torch.testing.assert_close(_full(param.grad), want, rtol=1e-4, atol=1e-5)
                checked += 1
        optimizer.step()
        for ref, *copies in zip(ref_stages, *(run[1] for run in ref_runs), strict=True):
            for p, *grads_from in zip(ref.parameters(), *(c.parameters() for c in copies), strict=True):
                p.grad = sum(g.grad for g in grads_from) / dp
        ref_optimizer.step()
    for s, module in mine.items():
        for param, ref_param in zip(module.stage.parameters(), ref_stages[s].parameters(), strict=True):
            torch.testing.assert_close(_full(param.detach()), ref_param.detach(), rtol=1e-4, atol=1e-5)
    dist.barrier()
    return checked


@pytest.mark.parametrize(
    "config",
    [
        InterleavedZeroBubbleScheduleConfig(stages_per_rank=1),
        ZBVScheduleConfig(),
        DualPipeVScheduleConfig(),
        # pairs taking turns between layers: FSDP's gathers and reductions of both halves interleave
        DualPipeVScheduleConfig(overlap=True),
    ],
    ids=["zb1p", "zbv", "dualpipev", "dualpipev_overlap"],
)
def test_split_backward_on_fsdp_stages_matches_one_process(config: PipelineScheduleConfig) -> None:
    checked = run_distributed(_train, config, False, world_size=4, timeout_s=180)
    assert min(checked) > 0


def test_split_backward_on_hsdp_stages_matches_one_process() -> None:
    checked = run_distributed(_train, ZBVScheduleConfig(), True, world_size=8, timeout_s=180)
    assert min(checked) > 0


def test_without_manual_finalization_the_backward_runs_whole_and_matches() -> None:
    checked = run_distributed(
        _train_without_manual_finalization, ZBVScheduleConfig(), world_size=4, timeout_s=180
    )
    assert min(checked) > 0


def _abort_then_step() -> None:
    """A step that fails after I and W leaves nothing behind: the next step's gradients are exact."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    runtime = StageRuntime(stage=0, num_stages=1, module=model)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, 4, generator=gen)  # [data-parallel rank, rows, features]
    rank = dist.get_rank()

    def loss_fn(outputs: torch.Tensor, microbatch: int) -> torch.Tensor:
        del microbatch
        return outputs.square().mean()

    runtime.begin_step(split_backward=True)
    runtime.forward(0, x[rank], None, loss_fn=loss_fn, training=True)
    runtime.backward_input(0, None)
    runtime.backward_weight(0)
    runtime.clear()  # the step failed before its reduction
    model.zero_grad()
    runtime.begin_step(split_backward=True)
    runtime.forward(0, x[rank], None, loss_fn=loss_fn, training=True)
    runtime.backward_input(0, None)
    runtime.backward_weight(0)
    runtime.end_backward()
    (sum(loss_fn(ref(x[r]), 0) for r in range(2)) / 2).backward()
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        assert param.grad is not None and ref_param.grad is not None
        torch.testing.assert_close(_full(param.grad), ref_param.grad)


@pytest.mark.skipif(
    not sharded_backward.manual_finalization_available(), reason="torch without FSDP manual finalization"
)
def test_a_failed_step_leaves_no_held_back_gradients() -> None:
    run_distributed(_abort_then_step, world_size=2, timeout_s=120)
