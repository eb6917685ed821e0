from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from torch import nn

from d9d.pipeline import LocalPipelineExecutor, build_1f1b_program, split_microbatches


@dataclass
class _Hidden:
    h: torch.Tensor
    tag: str


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class _Shared:
    bias: torch.Tensor


class _First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, inputs: _Pair, shared: _Shared) -> _Hidden:
        return _Hidden(h=self.lin(inputs.a) * inputs.b + shared.bias, tag="first")


class _Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, inputs: _Hidden, shared: _Shared) -> torch.Tensor:
        assert inputs.tag == "first"
        return self.lin(inputs.h + shared.bias)


def test_dataclass_and_namedtuple_trees() -> None:
    torch.manual_seed(0)
    first, last = _First(), _Last()
    batch = _Pair(a=torch.randn(4, 3), b=torch.randn(4, 1))
    shared = _Shared(bias=torch.randn(3))  # a dataclass: moved to the meta device for the trial
    program = build_1f1b_program(num_ranks=2, num_microbatches=2)
    losses = LocalPipelineExecutor(program, {0: first, 1: last}).step(
        batch, loss_fn=lambda out, m: out.square().sum(), shared=shared
    )
    ref = last(first(batch, shared), shared).square().sum()
    torch.testing.assert_close(sum(losses), ref.detach())


def test_split_microbatches() -> None:
    tree = {
        "x": torch.arange(6).reshape(6, 1),
        "meta": "keep",
        "pair": _Pair(torch.zeros(6), torch.ones(6, 2)),
    }
    pieces = split_microbatches(tree, 3)
    assert [p["x"].flatten().tolist() for p in pieces] == [[0, 1], [2, 3], [4, 5]]
    assert all(p["meta"] == "keep" and isinstance(p["pair"], _Pair) for p in pieces)
    with pytest.raises(ValueError, match=r"cannot split tensor 'pair\.b' of shape \(6, 2\) into 4"):
        split_microbatches({"pair": _Pair(torch.zeros(8), torch.ones(6, 2))}, 4)
