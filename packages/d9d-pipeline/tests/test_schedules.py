from collections import Counter

import pytest
from pydantic import TypeAdapter, ValidationError

from d9d.pipeline import (
    ActionKind,
    DualPipeVScheduleConfig,
    ForwardOnlyScheduleConfig,
    Interleaved1F1BScheduleConfig,
    OneFOneBScheduleConfig,
    PipelineScheduleConfig,
    build_program,
    stages_for_rank,
    stages_per_rank,
    validate_program,
)

from ._cases import TRAINING_SCHEDULES

ADAPTER: TypeAdapter[PipelineScheduleConfig] = TypeAdapter(PipelineScheduleConfig)
ALL_SCHEDULES = [*TRAINING_SCHEDULES, ForwardOnlyScheduleConfig()]


def _valid_counts(config: PipelineScheduleConfig, num_ranks: int) -> list[int]:
    counts = [1, 2, 3, 4, 5, 8, 12]
    match config:
        case Interleaved1F1BScheduleConfig():
            return [m for m in counts if m % num_ranks == 0]
        case DualPipeVScheduleConfig():
            return [m for m in counts if m >= 2 * num_ranks]
        case _:
            return counts


@pytest.mark.parametrize("config", ALL_SCHEDULES, ids=lambda c: c.name)
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_every_program_is_valid_and_complete(config: PipelineScheduleConfig, num_ranks: int) -> None:
    for num_mb in _valid_counts(config, num_ranks):
        program = build_program(config, num_ranks=num_ranks, num_microbatches=num_mb)
        validate_program(program)
        assert program.num_stages == num_ranks * stages_per_rank(config)
        kinds = Counter(a.kind for r in range(num_ranks) for a in program.compute_actions(r))
        n = program.num_stages * num_mb
        assert kinds[ActionKind.FORWARD] == n
        if program.training:
            assert kinds[ActionKind.BACKWARD] + kinds[ActionKind.BACKWARD_INPUT] == n
            assert kinds[ActionKind.BACKWARD_WEIGHT] == kinds[ActionKind.BACKWARD_INPUT]
        else:
            assert set(kinds) == {ActionKind.FORWARD}
        for rank in range(num_ranks):
            infos = stages_for_rank(config, num_ranks=num_ranks, rank=rank)
            assert [i.current_stage for i in infos] == program.stages_of(rank)
            assert all(i.num_stages == program.num_stages for i in infos)


@pytest.mark.parametrize(
    ("config", "num_ranks", "num_mb", "message"),
    [
        # interleaved 1F1B takes microbatches in groups of the rank count
        (
            Interleaved1F1BScheduleConfig(),
            4,
            6,
            "interleaved_1f1b: num_microbatches=6 must be a multiple of num_ranks=4",
        ),
        # DualPipeV needs 2 microbatches per rank
        (
            DualPipeVScheduleConfig(),
            4,
            6,
            "dualpipev: num_microbatches=6 is too few; this schedule needs at least 8",
        ),
        # no schedule runs without microbatches
        (OneFOneBScheduleConfig(), 2, 0, "1f1b: num_microbatches=0 is too few"),
    ],
)
def test_unusable_microbatch_counts(
    config: PipelineScheduleConfig, num_ranks: int, num_mb: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_program(config, num_ranks=num_ranks, num_microbatches=num_mb)


def test_config_union_is_discriminated_by_name() -> None:
    assert isinstance(ADAPTER.validate_python({"name": "1f1b"}), OneFOneBScheduleConfig)
    config = ADAPTER.validate_python({"name": "interleaved_1f1b", "stages_per_rank": 3})
    assert stages_per_rank(config) == 3
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        ADAPTER.validate_python({"name": "pipedream"})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        ADAPTER.validate_python({"name": "gpipe", "stages_per_rank": 2})
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ADAPTER.validate_python({"name": "looped_bfs", "stages_per_rank": 0})


def test_v_placement_puts_first_and_last_stage_on_rank_zero() -> None:
    program = build_program(DualPipeVScheduleConfig(), num_ranks=3, num_microbatches=6)
    assert program.stage_to_rank == (0, 1, 2, 2, 1, 0)


def test_stages_for_rank_rejects_a_rank_outside_the_group() -> None:
    with pytest.raises(ValueError, match="rank=2 is outside the 2 pipeline ranks"):
        stages_for_rank(OneFOneBScheduleConfig(), num_ranks=2, rank=2)


def test_program_prints_one_line_per_rank() -> None:
    program = build_program(OneFOneBScheduleConfig(), num_ranks=2, num_microbatches=2)
    assert program.format().splitlines()[1:] == ["rank 0: F0.0 F0.1 B0.0 B0.1", "rank 1: F1.0 B1.0 F1.1 B1.1"]
    assert "SA0.0->r1" in str(program)


def test_a_user_schedule_plugs_in_without_editing_d9d() -> None:
    from d9d.pipeline import PipelineProgram, PipelineScheduleBuilder, backward, forward, make_program

    class ReversedGPipe:
        """All forwards, then backwards in reverse microbatch order."""

        def build_program(self, *, num_ranks: int, num_microbatches: int) -> PipelineProgram:
            compute = [
                [forward(r, m) for m in range(num_microbatches)]
                + [backward(r, m) for m in reversed(range(num_microbatches))]
                for r in range(num_ranks)
            ]
            return make_program(
                num_microbatches=num_microbatches, stage_to_rank=range(num_ranks), compute=compute
            )

    schedule: PipelineScheduleBuilder = ReversedGPipe()
    program = build_program(schedule, num_ranks=2, num_microbatches=3)
    validate_program(program)
    assert [i.current_stage for i in program.stage_infos(1)] == [1]
