"""Forward and backward over one step's microbatches through a pipeline schedule."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from d9d.loop._stage_output_meta import StageOutputMeta
from d9d.loop._task import ComputeLossContext, TrainTask
from d9d.loop.step._gradient_manager import GradientManager
from d9d.loop.step._runner import MicrobatchTotals, loss_weight_of
from d9d.mesh import map_tree, shard_tree, tree_tensors
from d9d.pipeline import PipelineExecutor


class PipelineStageAdapter(nn.Module):
    """Presents a user's stage (``forward(inputs, shared)``) to the pipeline executor.

    The first stage's input may be a dataclass; it travels through the executor as a flat dict
    of tensors (split into microbatches there) and is rebuilt here. Output shapes come from a
    meta-device copy of the stage taken before parallelization, so the trial forward never
    touches the sharded parameters; a stage implementing ``StageOutputMeta`` states them itself.
    """

    def __init__(self, model: nn.Module, meta_model: nn.Module, *, is_first: bool) -> None:
        super().__init__()
        self.model = model
        self._meta_model = [meta_model]  # a list: not a submodule, so not in parameters()
        self._is_first = is_first
        self._template: Any = None

    def set_input_template(self, template: Any) -> None:
        """The step's full input: its structure and non-tensor leaves rebuild each microbatch."""
        self._template = template

    def _unflatten(self, inputs: Any) -> Any:
        if not self._is_first:
            return inputs
        flat: dict[str, torch.Tensor] = inputs
        return map_tree(self._template, lambda _t, path: flat[path])

    def forward(self, inputs: Any, shared: Any = None) -> Any:
        return self.model(self._unflatten(inputs), shared)

    def pipeline_output_meta(self, inputs: Any, shared: Any) -> Any:
        """Shapes of the stage's outputs, from the meta-device copy (its ``StageOutputMeta`` if any)."""
        meta_model = self._meta_model[0]
        if isinstance(meta_model, StageOutputMeta):
            return meta_model.pipeline_output_meta(self._unflatten(inputs), shared)
        return meta_model(self._unflatten(inputs), shared)


class PipelinedStepRunner:
    """Runs a step's microbatches through the configured schedule (d9d-pipeline's executor)."""

    def __init__(
        self,
        *,
        executor: PipelineExecutor,
        adapters: list[PipelineStageAdapter],
        stage_positions: dict[int, int],
        task: TrainTask[Any, Any, Any, Any, Any],
        gradients: GradientManager,
    ) -> None:
        self._executor = executor
        self._adapters = adapters
        self._stage_positions = stage_positions
        self._task = task
        self._gradients = gradients

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes the loss."""
        return self._executor.has_last_stage

    def run(
        self, *, inputs: Any, states: Any, shared: Any, num_microbatches: int, step: int
    ) -> MicrobatchTotals:
        totals = MicrobatchTotals()
        state_chunks = shard_tree(states, num_shards=num_microbatches)
        for adapter in self._adapters:
            adapter.set_input_template(inputs)
        flat_inputs = dict(tree_tensors(inputs))

        def loss_fn(outputs: Any, microbatch: int) -> torch.Tensor:
            result = self._task.compute_loss(
                ComputeLossContext(
                    pipeline_results=outputs,
                    state=state_chunks[microbatch],
                    microbatch_index=microbatch,
                    step=step,
                )
            )
            weight = loss_weight_of(result.loss_weight)
            totals.add(result.loss, weight)
            for name, value in result.metrics.items():
                totals.add_metric(name, value)
            return result.loss * (weight / num_microbatches)

        def before_weight_gradients(stage: int, microbatch: int, is_last: bool) -> None:
            # Reductions (FSDP's and d9d's bucketed all-reduce) run only in a stage's last
            # backward of the step, overlapped with it, as without pipelining.
            del microbatch
            self._gradients.begin_microbatch(is_last=is_last, stage_position=self._stage_positions[stage])

        self._executor.step(
            flat_inputs, loss_fn=loss_fn, shared=shared, weight_gradient_hook=before_weight_gradients
        )
        return totals
