"""The pipeline adapter asks a stage for its output shapes when the stage can state them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from d9d.loop import StageOutputMeta
from d9d.loop.step._pipelined_runner import PipelineStageAdapter


class _DataDependentStage(nn.Module):
    """A forward that cannot run on meta tensors (``nonzero``), stating its output instead."""

    def forward(self, inputs: torch.Tensor, shared: Any = None) -> torch.Tensor:
        del shared
        return inputs[inputs.nonzero(as_tuple=True)].reshape(inputs.shape) * 2

    def pipeline_output_meta(self, inputs: torch.Tensor, shared: Any) -> torch.Tensor:
        del shared
        return torch.empty_like(inputs, device="meta")


class _PlainStage(nn.Module):
    def forward(self, inputs: torch.Tensor, shared: Any = None) -> torch.Tensor:
        del shared
        return inputs.sum(dim=-1)


def test_adapter_uses_the_stated_output_meta_of_the_stage() -> None:
    stage = _DataDependentStage()
    assert isinstance(stage, StageOutputMeta)
    adapter = PipelineStageAdapter(stage, _DataDependentStage(), is_first=False)
    out = adapter.pipeline_output_meta(torch.empty(2, 3, device="meta"), None)
    assert out.shape == (2, 3) and out.is_meta


def test_adapter_runs_a_plain_stage_on_meta_tensors() -> None:
    stage = _PlainStage()
    assert not isinstance(stage, StageOutputMeta)
    adapter = PipelineStageAdapter(stage, _PlainStage(), is_first=False)
    out = adapter.pipeline_output_meta(torch.empty(2, 3, device="meta"), None)
    assert out.shape == (2,) and out.is_meta
