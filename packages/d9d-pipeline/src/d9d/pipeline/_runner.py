"""Executes one rank's actions over a transport; shared by the distributed and local executors."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from d9d.pipeline._actions import Action, ActionKind
from d9d.pipeline._overlap import Turns, pair_helper, run_pair
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
        # Stages in overlapped pairs record their overlap points and, on CUDA, run on their own
        # stream (a backward runs on its forward's stream, so every action of the stage does).
        overlap_stages: set[int] = set()
        acts = program.actions[rank]
        for i, action in enumerate(acts[:-1]):
            if action in program.overlapped:
                overlap_stages |= {action.stage, acts[i + 1].stage}
        self._streams: dict[int, torch.cuda.Stream] = {}
        for stage in overlap_stages:
            stages[stage].records_points = program.training
            if device.type == "cuda":
                self._streams[stage] = torch.cuda.Stream(device)
        self._paired_forward: Action | None = None  # an overlapped forward waiting for its backward
        self._pair_helper: ThreadPoolExecutor | None = None  # started by the first pair taking turns

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
        self._paired_forward = None
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
            case ActionKind.FORWARD if self._program.training and action in self._program.overlapped:
                self._paired_forward = action  # runs with the backward right after it
            case ActionKind.FORWARD:
                self._transport.flush()
                self._forward(s, m)
            case ActionKind.BACKWARD | ActionKind.BACKWARD_INPUT:
                self._transport.flush()
                split = action.kind == ActionKind.BACKWARD_INPUT and s not in self._whole_backward
                if not split:
                    self._before_weight_gradients(action)
                paired, self._paired_forward = self._paired_forward, None
                if paired is None:
                    self._backward(s, m, split=split)
                else:
                    self._overlapped(paired, s, m, split=split)
                self._after_weight_gradients(action)
            case ActionKind.BACKWARD_WEIGHT:
                self._transport.flush()
                if s not in self._whole_backward:  # else the I before it did the whole backward
                    self._before_weight_gradients(action)
                    with self._on_stage_stream(s, self._ambient()):
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

    def _ambient(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self._device) if self._streams else None

    @contextmanager
    def _on_stage_stream(
        self, stage: int, ambient: torch.cuda.Stream | None, *, ordered: bool = False
    ) -> Generator[None]:
        """Runs the block on ``stage``'s stream (CUDA, overlapped stages), ordered after ``ambient``.

        ``ordered``: the stream already waits for what it needs (no wait on ``ambient`` here).
        """
        stream = self._streams.get(stage)
        if stream is None or ambient is None:
            yield
            return
        if not ordered:
            stream.wait_stream(ambient)
        with torch.cuda.stream(stream):
            yield
        ambient.wait_stream(stream)

    def _record_on_stream(self, stage: int, tensors: list[torch.Tensor]) -> None:
        """Keeps tensors made on another stream alive until ``stage``'s stream is done with them."""
        stream = self._streams.get(stage)
        if stream is not None:
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(stream)

    def _forward_inputs(self, s: int, m: int) -> Any:
        if s == 0:
            return self._microbatches[m]
        if (s, m) in self._recv_trees:
            handle, inputs = self._recv_trees.pop((s, m))
            self._record_on_stream(s, handle.wait())
            return inputs
        inputs = self._activations.pop((s, m))
        if s in self._streams:
            self._record_on_stream(s, flatten_tree(inputs)[0])
        return inputs

    def _forward(self, s: int, m: int, at_points: Callable[[], None] | None = None) -> None:
        inputs = self._forward_inputs(s, m)
        with self._on_stage_stream(s, self._ambient()):
            outputs, loss = self._stages[s].forward(
                m,
                inputs,
                self._shared,
                loss_fn=self._loss_fn,
                training=self._program.training,
                at_points=at_points,
            )
        if self._stages[s].is_last:
            if loss is not None:
                self.losses[m] = loss
            else:
                self.outputs[m] = outputs
        elif self._where(s + 1) == self._rank:
            self._activations[(s + 1, m)] = outputs
        else:
            tensors, _, _ = flatten_tree(outputs)
            self._outgoing[(ActionKind.SEND_ACTIVATION, s, m)] = [t.contiguous() for t in tensors]

    def _output_grads_of(self, s: int, m: int) -> list[torch.Tensor] | None:
        if self._stages[s].is_last:
            return None
        pending = self._output_grads.pop((s, m))
        grads = pending if isinstance(pending, list) else pending.wait()
        self._record_on_stream(s, grads)
        return grads

    def _run_backward(
        self,
        s: int,
        m: int,
        grads: list[torch.Tensor] | None,
        *,
        split: bool,
        ambient: torch.cuda.Stream | None,
        at_points: Callable[[], None] | None = None,
        ordered: bool = False,
    ) -> list[torch.Tensor]:
        runtime = self._stages[s]
        with self._on_stage_stream(s, ambient, ordered=ordered):
            if split:
                return runtime.backward_input(m, grads, at_points=at_points)
            return runtime.backward(m, grads, at_points=at_points)

    def _backward(self, s: int, m: int, *, split: bool) -> None:
        grads = self._output_grads_of(s, m)
        self._deliver_input_grads(s, m, self._run_backward(s, m, grads, split=split, ambient=self._ambient()))

    def _deliver_input_grads(self, s: int, m: int, input_grads: list[torch.Tensor]) -> None:
        if s == 0:
            return
        if self._where(s - 1) == self._rank:
            self._output_grads[(s - 1, m)] = input_grads
        else:
            self._outgoing[(ActionKind.SEND_GRAD, s, m)] = [g.contiguous() for g in input_grads]

    def _overlapped(self, forward: Action, s: int, m: int, *, split: bool) -> None:
        """Runs ``forward`` and the backward of stage ``s`` on microbatch ``m``, taking turns.

        The forward runs on this thread, the backward on a helper thread against the stream that
        is current here (see :mod:`d9d.pipeline._overlap`).
        """
        grads = self._output_grads_of(s, m)
        ambient = self._ambient()
        backward_stream = self._streams.get(s)
        if backward_stream is not None and ambient is not None:
            # now, before the forward's work is ordered into the ambient stream: the backward
            # must not wait for the forward it runs beside
            backward_stream.wait_stream(ambient)
        if not self._stages[forward.stage].has_overlap_points and not self._stages[s].recorded_points(m):
            # one after the other, on their own streams: no thread to wake
            self._forward(forward.stage, forward.microbatch)
            input_grads = self._run_backward(s, m, grads, split=split, ambient=ambient, ordered=True)
            self._deliver_input_grads(s, m, input_grads)
            return
        turns = Turns()
        results: list[list[torch.Tensor]] = []

        def run_forward() -> None:
            self._forward(forward.stage, forward.microbatch, at_points=lambda: turns.pass_turn(0))

        def run_backward() -> None:
            results.append(
                self._run_backward(
                    s,
                    m,
                    grads,
                    split=split,
                    ambient=ambient,
                    at_points=lambda: turns.pass_turn(1),
                    ordered=True,
                )
            )

        if self._pair_helper is None:
            self._pair_helper = pair_helper()
        run_pair(run_forward, run_backward, turns, self._pair_helper)
        self._deliver_input_grads(s, m, results[0])

    def finish(self) -> None:
        """Posts what is left and waits for every send."""
        self._transport.flush()
        self._transport.finish()
