"""The weight-gradient hook: one call per (stage, microbatch), ``is_last`` on each stage's last."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from d9d.pipeline import (
    ActionKind,
    LocalPipelineExecutor,
    build_1f1b_program,
    build_gpipe_program,
    build_interleaved_zero_bubble_program,
)


@pytest.mark.parametrize(
    "program",
    [
        build_gpipe_program(num_ranks=2, num_microbatches=4),  # full backward actions
        build_1f1b_program(num_ranks=2, num_microbatches=4),
        # split backward: gradients of parameters accumulate in the weight actions
        build_interleaved_zero_bubble_program(num_ranks=2, num_microbatches=4, stages_per_rank=2),
    ],
    ids=["gpipe", "1f1b", "zero-bubble"],
)
def test_hook_marks_each_stages_last_weight_gradient(program) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    stages = {s: nn.Linear(4, 4) for s in range(program.num_stages)}
    calls: list[tuple[int, int, bool]] = []
    grads_at_last: dict[int, bool] = {}

    def hook(stage: int, microbatch: int, is_last: bool) -> None:
        calls.append((stage, microbatch, is_last))
        if is_last:  # nothing of this stage's last microbatch has accumulated yet
            grads_at_last[stage] = stages[stage].weight.grad is not None

    LocalPipelineExecutor(program, stages).step(
        torch.randn(8, 4), loss_fn=lambda out, m: out.square().mean(), weight_gradient_hook=hook
    )
    for stage in range(program.num_stages):
        mine = [c for c in calls if c[0] == stage]
        assert sorted(m for _, m, _ in mine) == list(range(program.num_microbatches))
        assert [last for _, _, last in mine] == [False] * (len(mine) - 1) + [True]
        assert grads_at_last[stage]  # earlier microbatches already accumulated
    weight_actions = [
        a
        for acts in program.actions
        for a in acts
        if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)
    ]
    assert len(calls) == len(weight_actions)
