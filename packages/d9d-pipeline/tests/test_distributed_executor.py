import pytest
import torch
import torch.distributed as dist
from torch import nn

from d9d.mesh.testing import DistributedTestError, run_distributed
from d9d.pipeline import (
    ForwardOnlyScheduleConfig,
    OneFOneBScheduleConfig,
    PipelineExecutor,
    PipelineScheduleConfig,
    PipelineShapeError,
    StagesOptimizer,
    ZBVScheduleConfig,
    build_1f1b_program,
    build_program,
    stages_for_rank,
)

from ._cases import TRAINING_SCHEDULES, microbatch_counts
from ._pipeline_model import build_stages, make_batch, make_loss_fn, reference

NUM_LAYERS = 8


def _train_and_compare(config: PipelineScheduleConfig, counts: list[int]) -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = []
    for num_mb in counts:
        program = build_program(config, num_ranks=world, num_microbatches=num_mb)
        assert [
            i.current_stage for i in stages_for_rank(config, num_ranks=world, rank=rank)
        ] == program.stages_of(rank)
        stages = build_stages(program.num_stages, NUM_LAYERS)
        inputs, shared, target = make_batch(16)
        ref_losses, ref_stages, ref_outputs = reference(stages, inputs, shared, target, num_mb)
        mine = {s: stages[s] for s in program.stages_of(rank)}
        executor = PipelineExecutor(program, mine)
        losses = executor.step(inputs, loss_fn=make_loss_fn(target, num_mb), shared=shared)
        if executor.has_last_stage:
            assert losses is not None
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-6, atol=1e-7)
        else:
            assert losses is None
        for s in mine:
            for param, ref_param in zip(stages[s].parameters(), ref_stages[s].parameters(), strict=True):
                assert param.grad is not None
                torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-7)
        outputs = executor.forward(inputs, shared=shared)  # the training program's forward-only view
        if executor.has_last_stage:
            assert outputs is not None
            for got, want in zip(outputs, ref_outputs, strict=True):
                torch.testing.assert_close(got["y"], want["y"])
        checked.append(num_mb)
    return checked


@pytest.mark.parametrize(
    "config", TRAINING_SCHEDULES, ids=lambda c: c.name + ("_overlap" if getattr(c, "overlap", False) else "")
)
@pytest.mark.parametrize("world_size", [2, 4])
def test_training_matches_reference(config: PipelineScheduleConfig, world_size: int) -> None:
    counts = microbatch_counts(config, world_size)
    results = run_distributed(_train_and_compare, config, counts, world_size=world_size, timeout_s=180)
    assert results == [counts] * world_size


def _forward_only() -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    program = build_program(ForwardOnlyScheduleConfig(), num_ranks=world, num_microbatches=4)
    stages = build_stages(world, NUM_LAYERS)
    inputs, shared, target = make_batch(8)
    _, _, ref_outputs = reference(stages, inputs, shared, target, 4)
    executor = PipelineExecutor(program, {rank: stages[rank]})
    outputs = executor.forward(inputs, shared=shared)
    if rank == world - 1:
        assert outputs is not None
        for got, want in zip(outputs, ref_outputs, strict=True):
            torch.testing.assert_close(got["y"], want["y"])
        return True
    assert outputs is None
    return False


def test_forward_only_matches_reference() -> None:
    assert run_distributed(_forward_only, world_size=4, timeout_s=120) == [False, False, False, True]


def _train_steps_with_optimizer() -> float:
    """Three 1F1B steps with SGD on every local stage equal three reference steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = OneFOneBScheduleConfig()
    program = build_program(config, num_ranks=world, num_microbatches=2)
    stages = build_stages(world, 4)
    ref_stages = build_stages(world, 4)
    ref_opt = torch.optim.SGD([p for s in ref_stages for p in s.parameters()], lr=0.1)
    optimizer = StagesOptimizer([torch.optim.SGD(stages[rank].parameters(), lr=0.1)])
    executor = PipelineExecutor(program, {rank: stages[rank]})
    for step in range(3):
        inputs, shared, target = make_batch(8, seed=step)
        optimizer.zero_grad()
        executor.step(inputs, loss_fn=make_loss_fn(target, 2), shared=shared)
        optimizer.step()
        ref_opt.zero_grad()
        _, ref_copy, _ = reference(ref_stages, inputs, shared, target, 2)
        for ref, grads_from in zip(ref_stages, ref_copy, strict=True):
            for p, g in zip(ref.parameters(), grads_from.parameters(), strict=True):
                p.grad = g.grad
        ref_opt.step()
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(stages[rank].parameters(), ref_stages[rank].parameters(), strict=True)
    )
    return diff


def test_optimizer_steps_match_reference() -> None:
    diffs = run_distributed(_train_steps_with_optimizer, world_size=2, timeout_s=120)
    assert max(diffs) < 1e-6


class _Widening(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)  # stage 1 expects 4 features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _mismatched_stages() -> None:
    rank = dist.get_rank()
    program = build_1f1b_program(num_ranks=2, num_microbatches=2)
    stage = _Widening() if rank == 0 else nn.Linear(4, 4)
    executor = PipelineExecutor(program, {rank: stage})
    executor.step(torch.randn(4, 4), loss_fn=lambda out, m: out.sum())


def test_mismatched_stages_fail_on_every_rank_before_sending() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_mismatched_stages, world_size=2, timeout_s=120, collective_timeout_s=30)
    text = str(info.value)
    assert "2 of 2 ranks failed" in text
    rank0, rank1 = text.split("--- rank 1 ---")
    assert PipelineShapeError.__name__ in rank0
    assert PipelineShapeError.__name__ in rank1
    assert "stage 1: the trial forward on meta tensors failed" in text


def _wrong_group_size() -> None:
    program = build_1f1b_program(num_ranks=3, num_microbatches=2)
    PipelineExecutor(program, {dist.get_rank(): nn.Linear(2, 2)})


def test_program_for_another_rank_count() -> None:
    with pytest.raises(DistributedTestError, match="the program is for 3 ranks but the pipeline group has 2"):
        run_distributed(_wrong_group_size, world_size=2, timeout_s=60)


def _changing_sequence_length() -> list[int]:
    rank = dist.get_rank()
    program = build_1f1b_program(num_ranks=2, num_microbatches=2)
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    executor = PipelineExecutor(program, {rank: layers[rank]})
    lengths = []
    for seq in (3, 5, 3):
        x = torch.randn(4, seq, 4)
        losses = executor.step(x, loss_fn=lambda out, m: out.sum())
        if executor.has_last_stage:
            assert losses is not None
            torch.testing.assert_close(sum(losses), layers[1](layers[0](x)).sum().detach())
        lengths.append(seq)
    return lengths


def test_shapes_may_change_between_steps() -> None:
    assert run_distributed(_changing_sequence_length, world_size=2, timeout_s=120) == [[3, 5, 3]] * 2


def _indivisible_batch() -> None:
    program = build_1f1b_program(num_ranks=2, num_microbatches=4)
    executor = PipelineExecutor(program, {dist.get_rank(): nn.Linear(4, 4)})
    executor.step(torch.randn(6, 4), loss_fn=lambda out, m: out.sum())


def test_indivisible_batch_fails_on_every_rank_before_sending() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_indivisible_batch, world_size=2, timeout_s=120, collective_timeout_s=30)
    text = str(info.value)
    assert "2 of 2 ranks failed" in text
    assert (
        text.count("the batch does not split into microbatches: cannot split tensor '<root>' of shape (6, 4)")
        == 2
    )


def _wrong_stages() -> None:
    program = build_program(ZBVScheduleConfig(), num_ranks=2, num_microbatches=2)
    PipelineExecutor(program, {dist.get_rank(): nn.Linear(2, 2)})  # each rank holds two stages


def test_stages_that_do_not_match_the_placement() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 0 holds stages \[0, 3\] of 4 under this program"):
        run_distributed(_wrong_stages, world_size=2, timeout_s=60)


def _two_pipelines() -> float:
    """4 ranks as 2 data-parallel replicas of a 2-rank pipeline: pipeline groups {0, 2} and {1, 3}."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    pp_rank = dist.get_rank(group)
    program = build_program(OneFOneBScheduleConfig(), num_ranks=2, num_microbatches=4)
    stages = build_stages(2, 4)
    inputs, shared, target = make_batch(8, seed=rank % 2)  # each replica its own data
    ref_losses, ref_stages, _ = reference(stages, inputs, shared, target, 4)
    executor = PipelineExecutor(program, {pp_rank: stages[pp_rank]}, group=group)
    losses = executor.step(inputs, loss_fn=make_loss_fn(target, 4), shared=shared)
    if losses is not None:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    return max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(stages[pp_rank].parameters(), ref_stages[pp_rank].parameters(), strict=True)
        if p.grad is not None and q.grad is not None
    )


def test_pipeline_group_inside_a_larger_world() -> None:
    assert max(run_distributed(_two_pipelines, world_size=4, timeout_s=120)) < 1e-6


def _count_exchanges(executor: PipelineExecutor) -> list[int]:
    """Wraps the executor's full shape exchange to count its runs (the count is the list's length)."""
    calls: list[int] = []
    exchange = executor._exchange_shapes

    def counted(*args: object) -> None:
        calls.append(1)
        exchange(*args)

    executor._exchange_shapes = counted  # type: ignore[method-assign]
    return calls


def _shapes_exchanged_only_on_change() -> list[int]:
    """ZBV on 2 ranks: the full exchange runs on the first step and when a batch or shared spec changes."""
    rank = dist.get_rank()
    program = build_program(ZBVScheduleConfig(), num_ranks=2, num_microbatches=4)
    stages = build_stages(program.num_stages, NUM_LAYERS)
    mine = {s: stages[s] for s in program.stages_of(rank)}
    executor = PipelineExecutor(program, mine)
    calls = _count_exchanges(executor)
    counts = []
    # (batch rows, shape of shared["scale"]): rank 0 alone sees a batch change, every rank a shared one
    for seed, (rows, scale_shape) in enumerate([(16, ()), (16, ()), (8, ()), (8, ()), (8, (1,)), (16, ())]):
        inputs, shared, target = make_batch(rows, seed=seed)
        shared = {"scale": shared["scale"].reshape(scale_shape)}
        for module in mine.values():
            module.zero_grad(set_to_none=True)
        ref_losses, ref_stages, ref_outputs = reference(stages, inputs, shared, target, 4)
        losses = executor.step(inputs, loss_fn=make_loss_fn(target, 4), shared=shared)
        if executor.has_last_stage:
            assert losses is not None
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-6, atol=1e-7)
        for s in mine:
            for param, ref_param in zip(stages[s].parameters(), ref_stages[s].parameters(), strict=True):
                torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-7)
        outputs = executor.forward(inputs, shared=shared)  # same shapes: no exchange
        if executor.has_last_stage:
            assert outputs is not None
            for got, want in zip(outputs, ref_outputs, strict=True):
                torch.testing.assert_close(got["y"], want["y"])
        counts.append(len(calls))
    return counts


def test_shapes_are_exchanged_only_when_they_change() -> None:
    expected = [1, 1, 2, 2, 3, 4]
    assert run_distributed(_shapes_exchanged_only_on_change, world_size=2, timeout_s=120) == [expected] * 2


class _TwoDimOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 2:
            raise ValueError(f"expected 2-D inputs, got {x.ndim}-D")
        return self.lin(x)


def _shape_error_after_a_good_step() -> tuple[list[str], list[int]]:
    """A good step, a step whose shapes fail at stage 0 or stage 1, then good steps again."""
    rank = dist.get_rank()
    program = build_1f1b_program(num_ranks=2, num_microbatches=2)
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 4), _TwoDimOnly()]
    executor = PipelineExecutor(program, {rank: layers[rank]})
    calls = _count_exchanges(executor)
    errors: list[str] = []
    counts: list[int] = []
    for shape in [(4, 4), (4, 3, 4), (4, 4), (4, 5), (4, 4), (4, 4)]:
        x = torch.randn(*shape)
        try:
            losses = executor.step(x, loss_fn=lambda out, m: out.sum())
        except PipelineShapeError as e:
            errors.append(str(e))
        else:
            if executor.has_last_stage:
                assert losses is not None
                torch.testing.assert_close(sum(losses), layers[1](layers[0](x)).sum().detach())
        counts.append(len(calls))
    return errors, counts


def test_shape_error_after_a_good_step_fails_on_every_rank() -> None:
    results = run_distributed(_shape_error_after_a_good_step, world_size=2, timeout_s=120)
    for errors, counts in results:
        assert len(errors) == 2
        assert errors[0].startswith("stage 1: the trial forward on meta tensors failed")
        assert "expected 2-D inputs, got 3-D" in errors[0]
        assert errors[1].startswith("stage 0: the trial forward on meta tensors failed")
        # every failed exchange is followed by a full one; the last step reuses the shapes
        assert counts == [1, 2, 3, 4, 5, 5]
    assert results[0] == results[1]
