import pytest

from d9d.pipeline import (
    Action,
    ActionKind,
    PipelineProgram,
    PipelineProgramError,
    backward,
    build_1f1b_program,
    forward,
    make_program,
    validate_program,
)


def _two_rank_program(rank0: list[Action], rank1: list[Action]) -> PipelineProgram:
    return PipelineProgram(num_microbatches=1, stage_to_rank=(0, 1), actions=(tuple(rank0), tuple(rank1)))


def _ra(stage: int, mb: int, peer: int) -> Action:
    return Action(kind=ActionKind.RECV_ACTIVATION, stage=stage, microbatch=mb, peer=peer)


def _sa(stage: int, mb: int, peer: int) -> Action:
    return Action(kind=ActionKind.SEND_ACTIVATION, stage=stage, microbatch=mb, peer=peer)


def _rg(stage: int, mb: int, peer: int) -> Action:
    return Action(kind=ActionKind.RECV_GRAD, stage=stage, microbatch=mb, peer=peer)


def _sg(stage: int, mb: int, peer: int) -> Action:
    return Action(kind=ActionKind.SEND_GRAD, stage=stage, microbatch=mb, peer=peer)


def test_missing_receive_is_named() -> None:
    program = _two_rank_program(
        [forward(0, 0), _sa(0, 0, 1), _rg(0, 0, 1), backward(0, 0)],
        [forward(1, 0), backward(1, 0), _sg(1, 0, 0)],  # no receive of the activation
    )
    with pytest.raises(
        PipelineProgramError,
        match=r"rank 0, action SA0\.0->r1 \(stage 0, microbatch 0\): no matching receive on rank 1",
    ):
        validate_program(program)


def test_cycle_is_a_deadlock() -> None:
    # rank 0 waits for the gradient before sending the activation rank 1 needs to produce it
    program = _two_rank_program(
        [forward(0, 0), _rg(0, 0, 1), _sa(0, 0, 1), backward(0, 0)],
        [_ra(1, 0, 0), forward(1, 0), backward(1, 0), _sg(1, 0, 0)],
    )
    with pytest.raises(PipelineProgramError) as info:
        validate_program(program)
    text = str(info.value)
    assert "rank 0, action RG0.0<-r1 (stage 0, microbatch 0): deadlock" in text
    assert "rank 1, action RA1.0<-r0 (stage 1, microbatch 0): deadlock" in text


def test_receives_out_of_send_order() -> None:
    base = build_1f1b_program(num_ranks=2, num_microbatches=2)
    rank1 = list(base.actions[1])
    first, second = rank1.index(_ra(1, 0, 0)), rank1.index(_ra(1, 1, 0))
    rank1[first], rank1[second] = rank1[second], rank1[first]
    broken = PipelineProgram(
        num_microbatches=2, stage_to_rank=(0, 1), actions=(base.actions[0], tuple(rank1))
    )
    with pytest.raises(
        PipelineProgramError,
        match=r"receive #0 from rank 0 is posted where the sender's #0 message is for RA1\.0",
    ):
        validate_program(broken)


@pytest.mark.parametrize(
    ("rank0", "rank1", "message"),
    [
        # microbatch 0 never runs backward on stage 1
        (
            [forward(0, 0), backward(0, 0)],
            [forward(1, 0)],
            r"stage 1, microbatch 0: backward runs B=0 I=0 W=0 times",
        ),
        # the forward of stage 0 runs twice
        (
            [forward(0, 0), forward(0, 0), backward(0, 0)],
            [forward(1, 0), backward(1, 0)],
            r"stage 0, microbatch 0: forward runs 2 times",
        ),
        # a stage computed on a rank that does not hold it
        (
            [forward(0, 0), forward(1, 0), backward(1, 0), backward(0, 0)],
            [],
            r"rank 0, action F1\.0 .*: stage 1 lives on rank 1",
        ),
        # backward before forward
        (
            [backward(0, 0), forward(0, 0)],
            [forward(1, 0), backward(1, 0)],
            r"rank 0, action B0\.0 .*: runs before the forward F0\.0",
        ),
    ],
)
def test_incomplete_or_misplaced_compute(rank0: list[Action], rank1: list[Action], message: str) -> None:
    program = make_program(num_microbatches=1, stage_to_rank=(0, 1), compute=[rank0, rank1])
    with pytest.raises(PipelineProgramError, match=message):
        validate_program(program)


def test_compute_without_its_receive() -> None:
    program = _two_rank_program(
        [forward(0, 0), _sa(0, 0, 1), backward(0, 0)],  # backward of stage 0 needs stage 1's gradient
        [_ra(1, 0, 0), forward(1, 0), backward(1, 0)],
    )
    with pytest.raises(
        PipelineProgramError,
        match=r"rank 0, action B0\.0 .*: reads data from rank 1 but no receive RG0\.0<-r1 precedes it",
    ):
        validate_program(program)
