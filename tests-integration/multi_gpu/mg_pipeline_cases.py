"""Every d9d-pipeline schedule over point-to-point sends on two ranks, against one process.

The stage model is d9d-pipeline's own test model (packages/d9d-pipeline/tests/_pipeline_model.py):
stages pass several tensors (float and int64) and share a tensor across stages.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from mg_case_env import Case, CaseEnv
from torch import nn

from d9d.pipeline import (
    DualPipeVScheduleConfig,
    ForwardOnlyScheduleConfig,
    GPipeScheduleConfig,
    Interleaved1F1BScheduleConfig,
    InterleavedZeroBubbleScheduleConfig,
    LoopedBFSScheduleConfig,
    OneFOneBScheduleConfig,
    PipelineExecutor,
    PipelineScheduleConfig,
    ZBVScheduleConfig,
    build_program,
)

_MODEL_FILE = Path(__file__).resolve().parents[2] / "packages/d9d-pipeline/tests/_pipeline_model.py"
NUM_LAYERS, STEPS, BATCH = 8, 3, 16


def _pipeline_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("d9d_pipeline_test_model", _MODEL_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _to(tree: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in tree.items()}


def _microbatches(config: PipelineScheduleConfig, world: int) -> int:
    match config:
        case DualPipeVScheduleConfig():
            return 2 * world
        case Interleaved1F1BScheduleConfig():
            return 2 * world
        case _:
            return 4


def _train(env: CaseEnv, config: PipelineScheduleConfig) -> str:
    pm = _pipeline_model()
    rank, world = dist.get_rank(), dist.get_world_size()
    num_mb = _microbatches(config, world)
    program = build_program(config, num_ranks=world, num_microbatches=num_mb)
    stages: list[nn.Module] = [s.to(env.device) for s in pm.build_stages(program.num_stages, NUM_LAYERS)]
    reference: list[nn.Module] = [s.to(env.device) for s in pm.build_stages(program.num_stages, NUM_LAYERS)]
    mine = {s: stages[s] for s in program.stages_of(rank)}
    executor = PipelineExecutor(program, mine)
    optimizer = torch.optim.AdamW([p for m in mine.values() for p in m.parameters()], lr=1e-2)
    ref_optimizer = torch.optim.AdamW([p for m in reference for p in m.parameters()], lr=1e-2)
    for step in range(STEPS):
        inputs, shared, target = pm.make_batch(BATCH, seed=step + 1)
        inputs, shared, target = _to(inputs, env.device), _to(shared, env.device), target.to(env.device)
        loss_fn = pm.make_loss_fn(target, num_mb)
        ref_losses: list[torch.Tensor] = []
        x_mbs, id_mbs = inputs["x"].chunk(num_mb), inputs["ids"].chunk(num_mb)
        for m in range(num_mb):
            tree: Any = {"x": x_mbs[m], "ids": id_mbs[m]}
            for stage in reference:
                tree = stage(tree, shared)
            loss = loss_fn(tree, m)
            loss.backward()
            ref_losses.append(loss.detach())
        losses = executor.step(inputs, loss_fn=loss_fn, shared=shared)
        if executor.has_last_stage:
            if losses is None:
                raise AssertionError("the last stage returned no losses")
            env.tolerance.check(torch.stack(losses), torch.stack(ref_losses), f"step {step} losses")
        for s, module in mine.items():
            for (name, p), q in zip(module.named_parameters(), reference[s].parameters(), strict=True):
                if p.grad is None or q.grad is None:
                    raise AssertionError(f"step {step}: stage {s} {name} has no gradient")
                env.tolerance.check(p.grad, q.grad, f"step {step} stage {s} grad {name}")
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        for s, module in mine.items():
            for (name, p), q in zip(module.named_parameters(), reference[s].parameters(), strict=True):
                env.tolerance.check(p.detach(), q.detach(), f"step {step} stage {s} param {name}")
    return f"{program.num_stages} stages, {num_mb} microbatches, {STEPS} AdamW steps"


def _forward_only(env: CaseEnv) -> str:
    pm = _pipeline_model()
    rank, world = dist.get_rank(), dist.get_world_size()
    program = build_program(ForwardOnlyScheduleConfig(), num_ranks=world, num_microbatches=4)
    stages: list[nn.Module] = [s.to(env.device) for s in pm.build_stages(world, NUM_LAYERS)]
    inputs, shared, target = pm.make_batch(8)
    inputs, shared, target = _to(inputs, env.device), _to(shared, env.device), target.to(env.device)
    _, _, ref_outputs = pm.reference(stages, inputs, shared, target, 4)
    outputs = PipelineExecutor(program, {rank: stages[rank]}).forward(inputs, shared=shared)
    if rank == world - 1:
        if outputs is None:
            raise AssertionError("the last stage returned no outputs")
        for m, (got, want) in enumerate(zip(outputs, ref_outputs, strict=True)):
            env.tolerance.check(got["y"], want["y"], f"microbatch {m} output")
    return "4 microbatches, outputs of the last stage"


def _schedule_case(config: PipelineScheduleConfig) -> Case:
    overlapped = isinstance(config, DualPipeVScheduleConfig) and config.overlap
    name = f"pp_{config.name}" + ("_overlap" if overlapped else "")
    return Case(name=name, run=lambda env: _train(env, config))


CASES = [
    *(
        _schedule_case(config)
        for config in (
            GPipeScheduleConfig(),
            OneFOneBScheduleConfig(),
            Interleaved1F1BScheduleConfig(stages_per_rank=2),
            LoopedBFSScheduleConfig(stages_per_rank=2),
            InterleavedZeroBubbleScheduleConfig(stages_per_rank=2),
            ZBVScheduleConfig(),
            DualPipeVScheduleConfig(),
            DualPipeVScheduleConfig(overlap=True),  # pairs on two streams per rank, over NCCL
        )
    ),
    Case(name="pp_forward_only", run=_forward_only),
]
