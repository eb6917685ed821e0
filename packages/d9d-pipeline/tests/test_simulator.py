import dataclasses
from pathlib import Path

import pytest

from d9d.pipeline import (
    ActionCosts,
    build_1f1b_program,
    build_dualpipev_program,
    build_forward_only_program,
    build_gpipe_program,
    build_interleaved_1f1b_program,
    build_interleaved_zero_bubble_program,
    build_looped_bfs_program,
    build_zbv_program,
    draw_timeline_png,
    simulate_program,
)

GRID = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 4, 8, 16, 32)]
SPLIT = ActionCosts(forward=1, backward=2, backward_input=1, backward_weight=1)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_and_1f1b_bubble(p: int, m: int) -> None:
    expected = (p - 1) / (m + p - 1)
    for program in (
        build_gpipe_program(num_ranks=p, num_microbatches=m),
        build_1f1b_program(num_ranks=p, num_microbatches=m),
    ):
        assert simulate_program(program).bubble_fraction == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m % p == 0])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_1f1b_and_looped_bfs_bubble(p: int, m: int, v: int) -> None:
    expected = (p - 1) / (v * m + p - 1)
    interleaved = build_interleaved_1f1b_program(num_ranks=p, num_microbatches=m, stages_per_rank=v)
    assert simulate_program(interleaved).bubble_fraction == pytest.approx(expected, abs=1e-12)
    bfs = build_looped_bfs_program(num_ranks=p, num_microbatches=m, stages_per_rank=v)
    assert simulate_program(bfs).bubble_fraction == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= 2 * p])
def test_zero_bubble_schedules_leave_only_the_fill(p: int, m: int) -> None:
    # Under F = I = W = 1 (the zero-bubble papers' assumption) nothing is idle except the pipeline
    # fill: one unit-cost action per hop, (p - 1) units per rank out of 3 v m of work; with v = 2
    # this is a third of interleaved 1F1B's bubble at the same stage count.
    fill = (p - 1) / (6 * m + p - 1)
    for program in (
        build_zbv_program(num_ranks=p, num_microbatches=m),
        build_dualpipev_program(num_ranks=p, num_microbatches=m),
        build_interleaved_zero_bubble_program(num_ranks=p, num_microbatches=m, stages_per_rank=2),
    ):
        result = simulate_program(program, SPLIT)
        assert result.bubble_fraction == pytest.approx(fill, abs=1e-12)
        assert result.bubble_fraction < 0.5 * (p - 1) / (2 * m + p - 1)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= 2 * p])
def test_dualpipev_overlapped_pairs_wait_for_both_inputs(p: int, m: int) -> None:
    # An overlapped pair starts when the forward's and the backward's inputs are both there, so a
    # rank idles (F&B + B - 3W)(p - 1) units, DualPipe's bubble, with F&B the pair's duration:
    # 2(p - 1) when the pair takes F + B (no gain), less as the overlap shortens the pair.
    program = build_dualpipev_program(num_ranks=p, num_microbatches=m, overlap=True)
    assert program.overlapped
    plain = simulate_program(program, SPLIT)
    assert plain.bubble_fraction == pytest.approx(2 * (p - 1) / (6 * m + 2 * (p - 1)), abs=1e-12)
    faster = simulate_program(program, dataclasses.replace(SPLIT, overlapped_pair=2.5))
    assert faster.makespan < plain.makespan
    for row in faster.timeline:
        pairs = [t for t in row if t.action in program.overlapped]
        assert pairs
        for t in pairs:
            after = row[row.index(t) + 1]
            assert after.start == pytest.approx(t.end)
            assert after.end - t.start == pytest.approx(2.5)


def test_peak_live_activations() -> None:
    p, m = 4, 8
    assert simulate_program(build_gpipe_program(num_ranks=p, num_microbatches=m)).peak_live_activations == (
        8,
        8,
        8,
        8,
    )
    assert simulate_program(build_1f1b_program(num_ranks=p, num_microbatches=m)).peak_live_activations == (
        4,
        3,
        2,
        1,
    )
    assert simulate_program(
        build_forward_only_program(num_ranks=p, num_microbatches=m)
    ).peak_live_activations == (1, 1, 1, 1)
    # DualPipeV: every rank holds about 2p + 1 half-size stage activations
    assert simulate_program(
        build_dualpipev_program(num_ranks=p, num_microbatches=m), SPLIT
    ).peak_live_activations == (9, 9, 9, 9)


def test_text_timeline() -> None:
    result = simulate_program(build_1f1b_program(num_ranks=2, num_microbatches=3))
    assert result.draw_text().splitlines() == [
        "r0 |F0F1....B0--F2B1--..B2--|",
        "r1 |..F0B0--F1B1--F2B2--....|",
        "bubble 0.250, makespan 12, peak live activations [2, 1]",
    ]


def test_png_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = simulate_program(build_zbv_program(num_ranks=2, num_microbatches=4), SPLIT)
    out = draw_timeline_png(result, tmp_path / "zbv.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_communication_latency_adds_to_the_makespan() -> None:
    program = build_1f1b_program(num_ranks=2, num_microbatches=1)
    assert simulate_program(program).makespan == 6
    assert simulate_program(program, ActionCosts(communication=0.5)).makespan == 7
