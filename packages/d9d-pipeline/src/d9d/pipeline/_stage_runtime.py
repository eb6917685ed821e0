"""One stage's per-microbatch state during a step: saved inputs, outputs, losses, backward parts."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.graph import Node

from d9d.pipeline._overlap import OverlapPoints, calls_at_nodes
from d9d.pipeline._shapes import PipelineShapeError, call_stage, check_against_spec
from d9d.pipeline._sharded_backward import ShardedSplitBackward
from d9d.pipeline._split_backward import WeightBackwardPlan, input_backward, weight_backward
from d9d.pipeline._tree import TreeSpec, flatten_tree, unflatten_tree

LossFn = Callable[[Any, int], torch.Tensor]
WeightGradientHook = Callable[[int, int, bool], None]
"""Called as ``hook(stage, microbatch, is_last)`` before each action that accumulates a stage's
parameter gradients (a full backward, or the weight half of a split backward); ``is_last`` is
true for the stage's last such action of the step. Gradient synchronizers use it to reduce only
once, overlapped with the last backward."""
"""Loss callback: ``(last stage outputs, microbatch index) -> loss tensor`` (already weighted)."""


@dataclass(kw_only=True)
class _Saved:
    inputs: list[torch.Tensor]  # stage inputs that receive gradients, in input_spec.grad_indices() order
    targets: list[torch.Tensor] = field(default_factory=list[torch.Tensor])
    grads: list[torch.Tensor | None] = field(default_factory=list[torch.Tensor | None])
    plan: WeightBackwardPlan | None = None
    points: list[Node] = field(default_factory=list[Node])  # graph nodes at the overlap points


class StageRuntime:
    """Runs one stage's forward and backward parts and keeps what lies between them."""

    def __init__(self, *, stage: int, num_stages: int, module: nn.Module) -> None:
        self.stage = stage
        self.records_points = False  # set by a runner whose program overlaps this stage
        # a runtime-checkable Protocol's isinstance costs tens of microseconds: checked once
        self._overlap_module: OverlapPoints | None = module if isinstance(module, OverlapPoints) else None
        self.num_stages = num_stages
        self.module = module
        self.input_spec: TreeSpec | None = None
        self.output_spec: TreeSpec | None = None
        self._saved: dict[int, _Saved] = {}
        self._sharded = ShardedSplitBackward(module)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def forward(
        self,
        microbatch: int,
        inputs: Any,
        shared: Any,
        *,
        loss_fn: LossFn | None,
        training: bool,
        at_points: Callable[[], None] | None = None,
    ) -> tuple[Any, torch.Tensor | None]:
        """Runs the forward (and the loss on the last stage when training).

        Args:
            microbatch: The microbatch's index.
            inputs: The stage's input tree.
            shared: Passed to the stage unchanged.
            loss_fn: The loss callback (last stage, training).
            training: Whether to build the graph and keep what the backward needs.
            at_points: Called at each overlap point of the stage (see :class:`OverlapPoints`).

        Returns:
            The outputs (detached from this stage's graph) and the loss (None unless last stage).
        """
        tensors, skeleton, _ = flatten_tree(inputs)
        grad_inputs: list[torch.Tensor] = []
        if training and not self.is_first:
            tensors = [t.detach() for t in tensors]
            for i, t in enumerate(tensors):
                if t.is_floating_point() or t.is_complex():
                    t.requires_grad_(True)
                    grad_inputs.append(t)
                    tensors[i] = t
            inputs = unflatten_tree(skeleton, tensors)
        points: list[Node] = []
        with torch.set_grad_enabled(training), self._overlap_points(points, at_points, training=training):
            outputs = call_stage(self.module, inputs, shared)
        if self.output_spec is not None:
            check_against_spec(stage=self.stage, what="outputs", tree=outputs, expected=self.output_spec)
        out_tensors, out_skeleton, _ = flatten_tree(outputs)
        loss: torch.Tensor | None = None
        saved = _Saved(inputs=grad_inputs, points=points)
        if training and self.is_last:
            if loss_fn is None:
                raise ValueError(f"stage {self.stage} is the last stage and needs a loss_fn to train")
            raw = cast(object, loss_fn(outputs, microbatch))  # user code: check what it returned
            if not isinstance(raw, torch.Tensor) or raw.numel() != 1:
                raise PipelineShapeError(
                    f"loss_fn must return a one-element tensor for microbatch {microbatch}, got {raw!r}"
                )
            loss = raw
            saved.targets = [loss.reshape(())]
            saved.grads = [None]
        elif training and self.output_spec is not None:
            for i in self.output_spec.grad_indices():
                saved.targets.append(out_tensors[i])
        if training:
            self._saved[microbatch] = saved
        detached = unflatten_tree(out_skeleton, [t.detach() for t in out_tensors])
        return detached, None if loss is None else loss.detach()

    @property
    def has_overlap_points(self) -> bool:
        """Whether the module marks overlap points, where a turn can change in its forward."""
        return self._overlap_module is not None

    def recorded_points(self, microbatch: int) -> bool:
        """Whether ``microbatch``'s forward recorded overlap points, where its backward passes turns."""
        saved = self._saved.get(microbatch)
        return saved is not None and bool(saved.points)

    @contextmanager
    def _overlap_points(
        self, points: list[Node], at_points: Callable[[], None] | None, *, training: bool
    ) -> Generator[None]:
        """Installs the stage's overlap point: records graph nodes for the backward, passes turns."""
        module = self._overlap_module
        record = training and self.records_points
        if module is None or (not record and at_points is None):
            yield
            return

        def point(tensor: torch.Tensor) -> None:
            if record and tensor.grad_fn is not None:
                points.append(tensor.grad_fn)
            if at_points is not None:
                at_points()

        module.set_overlap_point(point)
        try:
            yield
        finally:
            module.set_overlap_point(None)

    def _backward_points(self, saved: _Saved, at_points: Callable[[], None] | None) -> Any:
        return nullcontext() if at_points is None else calls_at_nodes(saved.points, at_points)

    def _set_output_grads(self, microbatch: int, output_grads: list[torch.Tensor] | None) -> _Saved:
        saved = self._saved[microbatch]
        if not self.is_last:
            if output_grads is None or len(output_grads) != len(saved.targets):
                raise RuntimeError(f"stage {self.stage}, microbatch {microbatch}: output gradients missing")
            pairs = [(t, g) for t, g in zip(saved.targets, output_grads, strict=True) if t.requires_grad]
            saved.targets = [t for t, _ in pairs]
            saved.grads = [g for _, g in pairs]
        return saved

    def _input_grads(self, saved: _Saved, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        return [torch.zeros_like(x) if g is None else g for x, g in zip(saved.inputs, grads, strict=True)]

    def begin_step(self, *, split_backward: bool) -> None:
        """Before a step; ``split_backward``: the step runs this stage's backward in parts.

        On FSDP modules a split backward defers gradient reduction to :meth:`end_backward`.
        """
        if split_backward:
            self._sharded.begin()

    def end_backward(self) -> None:
        """After the stage's last gradient-accumulating action of the step (reduces FSDP gradients)."""
        self._sharded.finish()

    def backward(
        self,
        microbatch: int,
        output_grads: list[torch.Tensor] | None,
        *,
        at_points: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        """Full backward: accumulates parameter gradients and returns the input gradients.

        ``at_points`` is called when autograd reaches a node recorded at an overlap point of this
        microbatch's forward.
        """
        saved = self._set_output_grads(microbatch, output_grads)
        self._sharded.before_backward(weight=False)
        if saved.targets:
            with self._backward_points(saved, at_points):
                torch.autograd.backward(saved.targets, saved.grads)
        grads = [x.grad for x in saved.inputs]
        del self._saved[microbatch]
        return self._input_grads(saved, grads)

    def backward_input(
        self,
        microbatch: int,
        output_grads: list[torch.Tensor] | None,
        *,
        at_points: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        """First half of a split backward: returns the input gradients and keeps what ``W`` needs.

        Only the input path of the graph runs here; the gradients leaving it towards the parameters
        are kept (see :mod:`d9d.pipeline._split_backward`). ``at_points`` as in :meth:`backward`.
        """
        saved = self._set_output_grads(microbatch, output_grads)
        self._sharded.before_backward(weight=False)
        with self._backward_points(saved, at_points):
            grads, saved.plan = input_backward(saved.targets, saved.grads, saved.inputs)
        saved.points = []
        saved.targets, saved.grads = [], []
        return self._input_grads(saved, grads)

    def backward_weight(self, microbatch: int) -> None:
        """Second half of a split backward: accumulates the parameter gradients, frees the graph."""
        saved = self._saved.pop(microbatch)
        if saved.plan is None:
            raise RuntimeError(f"stage {self.stage}, microbatch {microbatch}: W runs before I")
        self._sharded.before_backward(weight=True)
        weight_backward(saved.plan, [p for p in self.module.parameters() if p.requires_grad])

    def clear(self) -> None:
        """Drops everything kept for backward (after a failed or forward-only step)."""
        self._saved.clear()
        self._sharded.abort()  # a no-op unless the step failed with FSDP reductions held back
