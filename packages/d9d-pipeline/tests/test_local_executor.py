import pytest
import torch
from torch import nn

from d9d.pipeline import (
    ForwardOnlyScheduleConfig,
    LocalPipelineExecutor,
    PipelineScheduleConfig,
    PipelineShapeError,
    build_1f1b_program,
    build_program,
)

from ._cases import TRAINING_SCHEDULES, microbatch_counts
from ._pipeline_model import build_stages, make_batch, make_loss_fn, reference

NUM_LAYERS = 8


@pytest.mark.parametrize(
    "config", TRAINING_SCHEDULES, ids=lambda c: c.name + ("_overlap" if getattr(c, "overlap", False) else "")
)
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_training_matches_reference(config: PipelineScheduleConfig, num_ranks: int) -> None:
    for num_mb in microbatch_counts(config, num_ranks):
        program = build_program(config, num_ranks=num_ranks, num_microbatches=num_mb)
        stages = build_stages(program.num_stages, NUM_LAYERS)
        inputs, shared, target = make_batch(16)
        ref_losses, ref_stages, _ = reference(stages, inputs, shared, target, num_mb)
        executor = LocalPipelineExecutor(program, dict(enumerate(stages)))
        losses = executor.step(inputs, loss_fn=make_loss_fn(target, num_mb), shared=shared)
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-6, atol=1e-7)
        for stage, ref in zip(stages, ref_stages, strict=True):
            for (name, param), ref_param in zip(stage.named_parameters(), ref.parameters(), strict=True):
                assert param.grad is not None, name
                torch.testing.assert_close(param.grad, ref_param.grad, rtol=1e-5, atol=1e-7)


def test_forward_only_matches_reference() -> None:
    program = build_program(ForwardOnlyScheduleConfig(), num_ranks=3, num_microbatches=4)
    stages = build_stages(program.num_stages, NUM_LAYERS)
    inputs, shared, target = make_batch(8)
    _, _, ref_outputs = reference(stages, inputs, shared, target, 4)
    outputs = LocalPipelineExecutor(program, dict(enumerate(stages))).forward(inputs, shared=shared)
    assert len(outputs) == 4
    for got, want in zip(outputs, ref_outputs, strict=True):
        torch.testing.assert_close(got["y"], want["y"])
        assert torch.equal(got["ids"], want["ids"])
    assert all(p.grad is None for s in stages for p in s.parameters())


def test_step_needs_training_program() -> None:
    program = build_program(ForwardOnlyScheduleConfig(), num_ranks=2, num_microbatches=2)
    executor = LocalPipelineExecutor(program, dict(enumerate(build_stages(2, 2))))
    with pytest.raises(ValueError, match="forward-only"):
        executor.step(
            make_batch(4)[0], loss_fn=lambda out, m: out["y"].sum(), shared={"scale": torch.tensor(1.0)}
        )


def test_sequential_stages_without_shared() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(4)]
    program = build_1f1b_program(num_ranks=2, num_microbatches=2)
    stages = {0: nn.Sequential(*layers[:2]), 1: nn.Sequential(*layers[2:])}
    x = torch.randn(6, 4)
    losses = LocalPipelineExecutor(program, stages).step(x, loss_fn=lambda out, m: out.square().sum())
    ref = sum(nn.Sequential(*layers)(xm).square().sum() for xm in x.chunk(2))
    torch.testing.assert_close(sum(losses), ref.detach())


class _WrongOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)  # the next stage expects 4 features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_stage_output_that_does_not_fit_next_stage() -> None:
    program = build_1f1b_program(num_ranks=2, num_microbatches=2)
    stages = {0: _WrongOutput(), 1: nn.Linear(4, 4)}
    with pytest.raises(PipelineShapeError, match=r"stage 1: the trial forward .* \(2, 5\)"):
        LocalPipelineExecutor(program, stages).step(torch.randn(4, 4), loss_fn=lambda out, m: out.sum())


def test_wrong_stage_set() -> None:
    program = build_1f1b_program(num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"stages 0..1, got \[0\]"):
        LocalPipelineExecutor(program, {0: nn.Linear(4, 4)})


def test_batch_not_divisible_into_microbatches() -> None:
    program = build_1f1b_program(num_ranks=2, num_microbatches=4)
    executor = LocalPipelineExecutor(program, {0: nn.Linear(4, 4), 1: nn.Linear(4, 4)})
    with pytest.raises(ValueError, match=r"cannot split tensor '<root>' of shape \(6, 4\) into 4"):
        executor.step(torch.randn(6, 4), loss_fn=lambda out, m: out.sum())


class _NoMeta(nn.Module):
    """Reads a value (impossible on the meta device) and so declares its output shape itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = 1.0 if x.abs().sum().item() > 0 else 2.0
        return {"h": self.lin(x) * scale}

    def pipeline_output_meta(self, inputs: torch.Tensor, shared: object) -> dict[str, torch.Tensor]:
        return {"h": torch.empty(inputs.shape[0], 3, device="meta")}


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(inputs["h"])


def test_stage_declares_its_output_shape() -> None:
    torch.manual_seed(0)
    first, head = _NoMeta(), _Head()
    program = build_1f1b_program(num_ranks=2, num_microbatches=2)
    x = torch.randn(4, 4)
    losses = LocalPipelineExecutor(program, {0: first, 1: head}).step(x, loss_fn=lambda out, m: out.sum())
    torch.testing.assert_close(sum(losses), head(first(x)).sum().detach())
