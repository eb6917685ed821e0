"""cast_parameters_for_compute: forward in the compute dtype, float32 gradients, nothing else changes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from d9d.parallel import cast_parameters_for_compute


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.embed(ids))))


def test_forward_runs_on_bf16_copies_and_gradients_accumulate_in_float32() -> None:
    torch.manual_seed(0)
    model = _Tied()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    cast_parameters_for_compute(model, torch.bfloat16)
    ids = torch.randint(0, 16, (4, 5))
    for _ in range(2):  # two microbatches: gradients add up
        out = model(ids)
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
        reference(ids).float().square().mean().backward()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert not any(name in m.__dict__ for m in model.modules() for name in ("weight", "bias"))
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        # same bf16 products; float32 accumulation of the two microbatches and the tied uses
        torch.testing.assert_close(p.grad, q.grad.float(), atol=2e-2, rtol=2e-2, msg=name)
    assert model.head.weight is model.embed.weight  # the tie survives


def test_state_dict_and_optimizer_see_the_float32_parameters() -> None:
    model = nn.Linear(4, 4)
    cast_parameters_for_compute(model, torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    assert model.state_dict()["weight"].dtype == torch.float32
    assert not torch.equal(model.weight, before)


def test_a_failing_forward_leaves_no_shadow_and_materializing_is_followed() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    cast_parameters_for_compute(model, torch.bfloat16)
    model.to_empty(device="cpu")  # new parameter objects: the hooks must use them
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, dtype=torch.bfloat16))  # wrong width
    assert "weight" not in model.__dict__
    model.reset_parameters()
    out = model(torch.randn(2, 4, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_a_module_without_floating_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="no floating-point parameters"):
        cast_parameters_for_compute(nn.ReLU(), torch.bfloat16)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.body = self.eager_body

    def eager_body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()


def test_compiled_block_bodies_train_like_eager_under_the_cast() -> None:
    # Regional compilation, as d9d-hf compiles decoder layers: the hooks sit on the outer module,
    # the compiled bodies read the bf16 copies as graph inputs and send float32 gradients back.
    torch.manual_seed(0)
    eager, compiled = _Stack(), _Stack()
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.blocks:
        assert isinstance(block, _Block)
        block.body = torch.compile(block.eager_body, backend="aot_eager", fullgraph=True)
    optimizers = []
    for model in (eager, compiled):
        cast_parameters_for_compute(model, torch.bfloat16)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(3):
        x = torch.randn(4, 8).to(torch.bfloat16)
        losses = []
        for model, optimizer in zip((eager, compiled), optimizers, strict=True):
            optimizer.zero_grad()
            loss = model(x)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
        for (name, expected), got in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            assert got.dtype == torch.float32 and got.grad is not None and got.grad.dtype == torch.float32
            torch.testing.assert_close(got, expected, msg=name)
