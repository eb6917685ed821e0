"""Overlapped forward/backward pairs (DualPipeV): turns, collectives inside stages, errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from d9d.mesh.testing import run_distributed
from d9d.pipeline import (
    DualPipeVScheduleConfig,
    LocalPipelineExecutor,
    OverlapPoints,
    PipelineExecutor,
    PipelineProgram,
    PipelineProgramError,
    PipelineStageInfo,
    build_dualpipev_program,
    build_program,
    forward,
    make_program,
    validate_program,
)
from d9d.pipeline._overlap import Turns, pair_helper, run_pair

from ._pipeline_model import Stage, build_stages, make_batch, make_loss_fn, reference

NUM_LAYERS = 8


class _LoggedStage(Stage):
    """Logs ``("F", stage, layer)`` at each overlap point and ``("B", stage, layer)`` when the
    backward reaches that point's tensor."""

    def __init__(self, info: PipelineStageInfo, num_layers: int, log: list[tuple[str, int, int]]) -> None:
        super().__init__(info, num_layers)
        self._log = log
        self._count = 0

    def set_overlap_point(self, point: Callable[[torch.Tensor], None] | None) -> None:
        self._count = 0
        if point is None:
            super().set_overlap_point(None)
            return
        stage = self.info.current_stage

        def logged(h: torch.Tensor) -> None:
            layer = self._count
            self._count += 1
            self._log.append(("F", stage, layer))
            h.register_hook(lambda g: self._log.append(("B", stage, layer)) or g)  # pyright: ignore[reportUnknownLambdaType, reportUnknownArgumentType]
            point(h)

        super().set_overlap_point(logged)


def test_stage_model_has_overlap_points() -> None:
    assert isinstance(Stage(PipelineStageInfo(0, 2), 4), OverlapPoints)


def test_pair_takes_turns_at_overlap_points() -> None:
    program = build_dualpipev_program(num_ranks=2, num_microbatches=4, overlap=True)
    log: list[tuple[str, int, int]] = []
    torch.manual_seed(0)
    stages = {s: _LoggedStage(PipelineStageInfo(s, 4), NUM_LAYERS, log) for s in range(4)}
    plain = build_stages(4, NUM_LAYERS)
    for stage, ref in zip(stages.values(), plain, strict=True):
        stage.load_state_dict(ref.state_dict())
    inputs, shared, target = make_batch(8)
    ref_losses, ref_stages, _ = reference(plain, inputs, shared, target, 4)
    losses = LocalPipelineExecutor(program, stages).step(
        inputs, loss_fn=make_loss_fn(target, 4), shared=shared
    )
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for s, stage in stages.items():
        for p, ref in zip(stage.parameters(), ref_stages[s].parameters(), strict=True):
            torch.testing.assert_close(p.grad, ref.grad)
    # Rank 0's first pair is F0.2 with B3.1: two layers each, the forward first, then turns.
    first = next(
        i
        for i, (kind, stage, _) in enumerate(log)
        if kind == "F" and stage == 0 and i > 0 and any(k == "B" for k, _, _ in log[:i])
    )
    assert log[first : first + 4] == [("F", 0, 0), ("B", 3, 1), ("F", 0, 1), ("B", 3, 0)]


def test_overlap_off_runs_pairs_one_after_the_other() -> None:
    program = build_program(DualPipeVScheduleConfig(overlap=False), num_ranks=2, num_microbatches=4)
    assert not program.overlapped
    log: list[tuple[str, int, int]] = []
    torch.manual_seed(0)
    stages = {s: _LoggedStage(PipelineStageInfo(s, 4), NUM_LAYERS, log) for s in range(4)}
    inputs, shared, target = make_batch(8)
    LocalPipelineExecutor(program, stages).step(inputs, loss_fn=make_loss_fn(target, 4), shared=shared)
    assert log == []  # no pair: the overlap points are never installed


def test_turns_alternate_and_errors_reach_the_caller() -> None:
    order: list[str] = []
    turns = Turns()

    def side(name: str, side_index: int, steps: int) -> Callable[[], None]:
        def run() -> None:
            for k in range(steps):
                order.append(f"{name}{k}")
                turns.pass_turn(side_index)

        return run

    helper = pair_helper()
    run_pair(side("f", 0, 3), side("b", 1, 2), turns, helper)
    assert order == ["f0", "b0", "f1", "b1", "f2"]

    def failing() -> None:
        turns_b.pass_turn(1)
        raise RuntimeError("backward failed")

    turns_b = Turns()
    finished: list[str] = []
    with pytest.raises(RuntimeError, match="backward failed"):
        run_pair(
            lambda: (turns_b.pass_turn(0), turns_b.pass_turn(0), finished.append("f")),
            failing,
            turns_b,
            helper,
        )
    assert finished == ["f"]  # the forward ran to its end, then the backward's error was raised

    turns_f = Turns()
    with pytest.raises(ValueError, match="forward failed"):
        run_pair(
            lambda: (_ for _ in ()).throw(ValueError("forward failed")),
            lambda: finished.append("b"),
            turns_f,
            helper,
        )
    assert finished == ["f", "b"]


def test_validator_checks_overlapped_actions() -> None:
    program = build_dualpipev_program(num_ranks=2, num_microbatches=4, overlap=True)
    validate_program(program)
    first = program.actions[0][0]
    bad = PipelineProgram(
        num_microbatches=program.num_microbatches,
        stage_to_rank=program.stage_to_rank,
        actions=program.actions,
        overlapped=program.overlapped | {first},
    )
    with pytest.raises(PipelineProgramError, match=r"F0\.0.*is overlapped but is not directly followed"):
        validate_program(bad)
    compute = [list(program.compute_actions(r)) for r in range(2)]
    no_forward = make_program(
        num_microbatches=4,
        stage_to_rank=program.stage_to_rank,
        compute=compute,
        overlapped=frozenset({forward(5, 0)}),
    )
    with pytest.raises(PipelineProgramError, match=r"overlapped action F5\.0 is not a forward"):
        validate_program(no_forward)


class _CoupledMean(torch.autograd.Function):
    """``x + mean of x over the group``: an all-reduce forward and backward, like expert parallelism's
    all-to-all. A forward collective matched with a backward one on the peer would mix activations
    with gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        return x + total / dist.get_world_size(group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return grad + total / dist.get_world_size(ctx.group), None


class _CoupledStage(nn.Module):
    def __init__(self, info: PipelineStageInfo, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.info = info
        self.group = group
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self._point: Callable[[torch.Tensor], None] | None = None

    def set_overlap_point(self, point: Callable[[torch.Tensor], None] | None) -> None:
        self._point = point

    def pipeline_output_meta(self, inputs: dict[str, torch.Tensor], shared: Any) -> dict[str, torch.Tensor]:
        del shared
        return {"h": torch.empty_like(inputs["h"])}  # no collective in the shape trial

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = inputs["h"]
        for layer in self.layers:
            h = torch.tanh(layer(h))
            h = _CoupledMean.apply(h, self.group)
            if self._point is not None:
                self._point(h)
        return {"h": h}


def _coupled(overlap: bool) -> tuple[list[float], dict[int, list[torch.Tensor]]]:
    # 4 ranks: pipeline groups [0, 1] and [2, 3]; "expert" groups [0, 2] and [1, 3] couple the
    # same pipeline rank of both pipelines, whose programs issue their collectives in step.
    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    experts = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp_rank, replica = rank % 2, rank // 2
    program = build_program(DualPipeVScheduleConfig(overlap=overlap), num_ranks=2, num_microbatches=6)
    torch.manual_seed(0)
    stages = {s: _CoupledStage(PipelineStageInfo(s, 4), experts[pp_rank]) for s in range(4)}
    mine = {s: stages[s] for s in program.stages_of(pp_rank)}
    executor = PipelineExecutor(program, mine, group=pipelines[replica])
    gen = torch.Generator().manual_seed(10 + replica)
    inputs = {"h": torch.randn(12, 8, generator=gen)}
    target = torch.randn(12, 8, generator=gen)

    def loss_fn(outputs: dict[str, torch.Tensor], m: int) -> torch.Tensor:
        return ((outputs["h"] - target.chunk(6)[m]) ** 2).mean()

    losses = executor.step(inputs, loss_fn=loss_fn)
    grads = {s: [p.grad.clone() for p in m.parameters() if p.grad is not None] for s, m in mine.items()}
    return [float(x) for x in losses or []], grads


def _overlapped_matches_serial() -> bool:
    serial = _coupled(False)
    overlapped = _coupled(True)
    assert overlapped[0] == serial[0]
    for s, grads in serial[1].items():
        assert len(grads) == 6
        for got, want in zip(overlapped[1][s], grads, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    return True


def test_collectives_inside_overlapped_stages_match_serial() -> None:
    assert run_distributed(_overlapped_matches_serial, world_size=4, timeout_s=120) == [True] * 4


def test_helper_thread_keeps_the_callers_intra_op_threads() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        helper = pair_helper()
        assert helper.submit(torch.get_num_threads).result() == 1
    finally:
        torch.set_num_threads(before)


class _FailOnce(Stage):
    """Raises in the forward at one overlap point of one chosen call, once."""

    def __init__(self, info: PipelineStageInfo, num_layers: int, fail_at_call: int) -> None:
        super().__init__(info, num_layers)
        self.calls = 0
        self.fail_at_call = fail_at_call

    def set_overlap_point(self, point: Callable[[torch.Tensor], None] | None) -> None:
        if point is None:
            super().set_overlap_point(None)
            return
        self.calls += 1
        call = self.calls

        def failing(h: torch.Tensor) -> None:
            if call == self.fail_at_call:
                raise RuntimeError(f"stage {self.info.current_stage} failed in call {call}")
            point(h)

        super().set_overlap_point(failing)


def test_a_failed_pair_raises_and_the_next_step_runs_as_the_reference() -> None:
    # Stage 3's third forward runs in a pair on rank 0 (F3.2+ B0.0 in DualPipeV p=2, m=4).
    program = build_dualpipev_program(num_ranks=2, num_microbatches=4, overlap=True)
    torch.manual_seed(0)
    plain = build_stages(4, NUM_LAYERS)
    stages: dict[int, Stage] = {}
    for s, ref in enumerate(plain):
        stages[s] = _FailOnce(PipelineStageInfo(s, 4), NUM_LAYERS, fail_at_call=3 if s == 3 else -1)
        stages[s].load_state_dict(ref.state_dict())
    executor = LocalPipelineExecutor(program, stages)
    inputs, shared, target = make_batch(8)
    loss_fn = make_loss_fn(target, 4)
    with pytest.raises(RuntimeError, match="stage 3 failed in call 3"):
        executor.step(inputs, loss_fn=loss_fn, shared=shared)
    for stage in stages.values():
        stage.zero_grad(set_to_none=True)
    losses = executor.step(inputs, loss_fn=loss_fn, shared=shared)
    ref_losses, ref_stages, _ = reference(plain, inputs, shared, target, 4)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for s, stage in stages.items():
        for p, ref in zip(stage.parameters(), ref_stages[s].parameters(), strict=True):
            torch.testing.assert_close(p.grad, ref.grad)
