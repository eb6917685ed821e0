"""Forward-only passes over a batch's microbatches (evaluation, inference): plain or pipelined."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from d9d.loop._model_stage_factory import BuiltStage
from d9d.loop.step._pipelined_runner import PipelineStageAdapter
from d9d.mesh import DistributedContext, shard_tree, tree_tensors
from d9d.pipeline import PipelineExecutor, PipelineProgram


class ForwardRunner(Protocol):
    """Runs the model's forwards over one batch, without autograd."""

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank receives the model's outputs (holds the last pipeline stage)."""
        ...

    def forward(self, *, inputs: Any, shared: Any, num_microbatches: int) -> list[Any] | None:
        """The outputs of every microbatch in order (on the last stage), else None."""
        ...


@contextmanager
def evaluation_mode(models: Sequence[nn.Module]) -> Generator[None]:
    """``eval()`` (dropout off) and no autograd inside; each module's previous mode restored after."""
    modes = [m.training for m in models]
    for model in models:
        model.train(False)
    try:
        with torch.no_grad():
            yield
    finally:
        for model, mode in zip(models, modes, strict=True):
            model.train(mode)


class SequentialForwardRunner:
    """Microbatch after microbatch on one model stage."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    @property
    def has_last_stage(self) -> bool:
        return True

    def forward(self, *, inputs: Any, shared: Any, num_microbatches: int) -> list[Any] | None:
        with evaluation_mode([self._model]):
            return [self._model(chunk, shared) for chunk in shard_tree(inputs, num_shards=num_microbatches)]


class PipelinedForwardRunner:
    """The microbatches through a pipeline program's forwards (d9d-pipeline's ``forward``)."""

    def __init__(
        self, *, program: PipelineProgram, stages: Sequence[BuiltStage[Any]], dist_context: DistributedContext
    ) -> None:
        self._adapters: dict[int, PipelineStageAdapter] = {}
        for s in stages:
            if s.meta_model is None:
                raise RuntimeError(f"stage {s.stage.current_stage} was built without its meta copy")
            self._adapters[s.stage.current_stage] = PipelineStageAdapter(
                s.model, s.meta_model, is_first=s.stage.is_first
            )
        self._models = [s.model for s in stages]
        self._executor = PipelineExecutor(
            program, self._adapters, group=dist_context.pipeline_group(), device=dist_context.device
        )

    @property
    def has_last_stage(self) -> bool:
        return self._executor.has_last_stage

    def forward(self, *, inputs: Any, shared: Any, num_microbatches: int) -> list[Any] | None:
        if num_microbatches != self._executor.program.num_microbatches:
            raise ValueError(
                f"the pipeline program runs {self._executor.program.num_microbatches} microbatches, "
                f"not {num_microbatches}"
            )
        for adapter in self._adapters.values():
            adapter.set_input_template(inputs)
        with evaluation_mode(self._models):
            return self._executor.forward(dict(tree_tensors(inputs)), shared=shared)
