"""Executes one rank's actions over a transport; shared by the distributed and local executors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any, Protocol

import torch

from d9d.pipeline._actions import Action, ActionKind
from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._stage_runtime import LossFn, StageRuntime, WeightGradientHook
from d9d.pipeline._tree import TreeSpec, flatten_tree


class RecvHandle(Protocol):
    """A posted receive; ``wait`` returns the received tensors."""

    def wait(self) -> list[torch.Tensor]: ...


class Transport(Protocol):
    """How a rank's sends and receives travel (point-to-point ops, or an in-process mailbox)."""

    def send(self, action: Action, tensors: list[torch.Tensor]) -> None: ...

    def recv(self, action: Action, buffers: list[torch.Tensor]) -> RecvHandle: ...

    def flush(self) -> None:
        """Posts the sends and receives collected since the last flush (one batch)."""
        ...

    def finish(self) -> None:
        """Waits for every send of the step."""
        ...


class RankRunner:
    """Holds one rank's stages and the data between its actions during one step."""

    def __init__(
        self,
        *,
        program: PipelineProgram,
        rank: int,
        stages: Mapping[int, StageRuntime],
        transport: Transport,
        device: torch.device,
        whole_backward: Set[int] = frozenset(),
    ) -> None:
        self._program = program
        self._rank = rank
        self._stages = stages
        self._transport = transport
        self._device = device
        self._weight_hook: WeightGradientHook | None = None
        # Stages whose split backward runs whole in I (FSDP on a torch without manual finalization).
        self._whole_backward = whole_backward
        self._last_weight_action: dict[int, Action] = {}
        self._split_stages: set[int] = set()
        for action in program.actions[rank]:
            whole = action.stage in whole_backward
            grad_kinds = (
                ActionKind.BACKWARD,
                ActionKind.BACKWARD_INPUT if whole else ActionKind.BACKWARD_WEIGHT,
            )
            if action.kind in grad_kinds:
                self._last_weight_action[action.stage] = action
            if action.kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT) and not whole:
                self._split_stages.add(action.stage)
        self._microbatches: Sequence[Any] = ()
        self._shared: Any = None
        self._loss_fn: LossFn | None = None
        self._activations: dict[tuple[int, int], Any] = {}  # (stage, mb) -> input tree or recv handle
        self._recv_trees: dict[tuple[int, int], tuple[RecvHandle, object]] = {}
        self._output_grads: dict[tuple[int, int], list[torch.Tensor] | RecvHandle] = {}
        self._outgoing: dict[tuple[ActionKind, int, int], list[torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}

    def start(
        self,
        *,
        microbatches: Sequence[Any],
        shared: Any,
        loss_fn: LossFn | None,
        weight_hook: WeightGradientHook | None = None,
    ) -> None:
        """Resets the per-step state."""
        self._microbatches, self._shared, self._loss_fn = microbatches, shared, loss_fn
        self._weight_hook = weight_hook
        self._activations.clear()
        self._recv_trees.clear()
        self._output_grads.clear()
        self._outgoing.clear()
        self.losses, self.outputs = {}, {}
        for stage, runtime in self._stages.items():
            runtime.begin_step(split_backward=stage in self._split_stages)

    def _where(self, stage: int) -> int:
        return self._program.stage_to_rank[stage]

    def _spec(self, stage: int, *, inputs: bool) -> TreeSpec:
        runtime = self._stages[stage]
        spec = runtime.input_spec if inputs else runtime.output_spec
        if spec is None:
            raise RuntimeError(f"stage {stage}: shapes were not inferred before the step")
        return spec

    def execute(self, action: Action) -> None:
        """Runs one action (communication is posted at the next compute action or at the end)."""
        s, m = action.stage, action.microbatch
        match action.kind:
            case ActionKind.SEND_ACTIVATION | ActionKind.SEND_GRAD:
                self._transport.send(action, self._outgoing.pop((action.kind, s, m)))
            case ActionKind.RECV_ACTIVATION:
                buffers, tree = self._spec(s, inputs=True).empty(self._device)
                self._recv_trees[(s, m)] = (self._transport.recv(action, buffers), tree)
            case ActionKind.RECV_GRAD:
                spec = self._spec(s, inputs=False)
                buffers = [
                    torch.empty(spec.tensors[i].shape, dtype=spec.tensors[i].dtype, device=self._device)
                    for i in spec.grad_indices()
                ]
                self._output_grads[(s, m)] = self._transport.recv(action, buffers)
            case ActionKind.FORWARD:
                self._transport.flush()
                self._forward(s, m)
            case ActionKind.BACKWARD | ActionKind.BACKWARD_INPUT:
                self._transport.flush()
                split = action.kind == ActionKind.BACKWARD_INPUT and s not in self._whole_backward
                if not split:
                    self._before_weight_gradients(action)
                self._backward(s, m, split=split)
                self._after_weight_gradients(action)
            case ActionKind.BACKWARD_WEIGHT:
                self._transport.flush()
                if s not in self._whole_backward:  # else the I before it did the whole backward
                    self._before_weight_gradients(action)
                    self._stages[s].backward_weight(m)
                    self._after_weight_gradients(action)

    def _before_weight_gradients(self, action: Action) -> None:
        if self._weight_hook is not None:
            self._weight_hook(
                action.stage, action.microbatch, self._last_weight_action.get(action.stage) == action
            )

    def _after_weight_gradients(self, action: Action) -> None:
        # Sends queued before this action were posted at its start; the data-parallel peers
        # reach this reduction at the same point of the same program.
        if self._last_weight_action.get(action.stage) == action:
            self._stages[action.stage].end_backward()

    def _forward(self, s: int, m: int) -> None:
        runtime = self._stages[s]
        if s == 0:
            inputs = self._microbatches[m]
        elif (s, m) in self._recv_trees:
            handle, inputs = self._recv_trees.pop((s, m))
            handle.wait()
        else:
            inputs = self._activations.pop((s, m))
        outputs, loss = runtime.forward(
            m, inputs, self._shared, loss_fn=self._loss_fn, training=self._program.training
        )
        if runtime.is_last:
            if loss is not None:
                self.losses[m] = loss
            else:
                self.outputs[m] = outputs
        elif self._where(s + 1) == self._rank:
            self._activations[(s + 1, m)] = outputs
        else:
            tensors, _, _ = flatten_tree(outputs)
            self._outgoing[(ActionKind.SEND_ACTIVATION, s, m)] = [t.contiguous() for t in tensors]

    def _backward(self, s: int, m: int, *, split: bool) -> None:
        runtime = self._stages[s]
        grads: list[torch.Tensor] | None = None
        if not runtime.is_last:
            pending = self._output_grads.pop((s, m))
            grads = pending if isinstance(pending, list) else pending.wait()
        input_grads = runtime.backward_input(m, grads) if split else runtime.backward(m, grads)
        if s == 0:
            return
        if self._where(s - 1) == self._rank:
            self._output_grads[(s - 1, m)] = input_grads
        else:
            self._outgoing[(ActionKind.SEND_GRAD, s, m)] = [g.contiguous() for g in input_grads]

    def finish(self) -> None:
        """Posts what is left and waits for every send."""
        self._transport.flush()
        self._transport.finish()
