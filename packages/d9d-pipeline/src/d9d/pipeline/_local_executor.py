"""Runs every rank of a program in one process, for debugging and tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from d9d.pipeline._actions import Action
from d9d.pipeline._executor_base import forward_only_view
from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._runner import RankRunner
from d9d.pipeline._shapes import infer_output_spec
from d9d.pipeline._stage_runtime import LossFn, StageRuntime, WeightGradientHook
from d9d.pipeline._tree import spec_of, split_microbatches
from d9d.pipeline._validator import validate_program


class _Delivered:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors

    def wait(self) -> list[torch.Tensor]:
        return self._tensors


class _Mailbox:
    """Sends copy tensors into a shared mailbox; a receive takes them (it runs only once they are there)."""

    def __init__(self, rank: int, boxes: dict[tuple[int, Action], list[torch.Tensor]]) -> None:
        self._rank = rank
        self._boxes = boxes

    def send(self, action: Action, tensors: list[torch.Tensor]) -> None:
        self._boxes[(action.peer_rank, action.matching(own_rank=self._rank))] = [
            t.detach().clone() for t in tensors
        ]

    def recv(self, action: Action, buffers: list[torch.Tensor]) -> _Delivered:
        got = self._boxes.pop((self._rank, action))
        for buffer, tensor in zip(buffers, got, strict=True):
            buffer.copy_(tensor)
        return _Delivered(buffers)

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        pass


class LocalPipelineExecutor:
    """Runs a program with all its stages in this process, with :class:`PipelineExecutor`'s semantics.

    Ranks take turns: each runs its actions in order until it reaches a receive whose message has
    not been sent yet. Messages are copied, shapes are inferred and checked as in the distributed
    executor, so a program and stages that work here work on real ranks.

    Args:
        program: The program (validated here).
        stages: Every stage's module by stage index.
        device: Where receive buffers live; CPU when None.
    """

    def __init__(
        self, program: PipelineProgram, stages: Mapping[int, nn.Module], *, device: torch.device | None = None
    ) -> None:
        if sorted(stages) != list(range(program.num_stages)):
            raise ValueError(f"expected modules for stages 0..{program.num_stages - 1}, got {sorted(stages)}")
        validate_program(program)
        self._program = program
        self._device = device or torch.device("cpu")
        self._runtimes = {
            s: StageRuntime(stage=s, num_stages=program.num_stages, module=m) for s, m in stages.items()
        }
        self._forward_program: PipelineProgram | None = None
        # Runners (their CUDA streams and pair helper threads) and their mailbox, per program kind:
        # built once, reset by start() every step.
        self._runners: dict[bool, tuple[list[RankRunner], dict[tuple[int, Action], list[torch.Tensor]]]] = {}

    @property
    def program(self) -> PipelineProgram:
        """The program this executor runs."""
        return self._program

    def step(
        self,
        inputs: Any,
        *,
        loss_fn: LossFn,
        shared: Any = None,
        weight_gradient_hook: WeightGradientHook | None = None,
    ) -> list[torch.Tensor]:
        """Forward and backward of every microbatch; see :meth:`PipelineExecutor.step`.

        Returns:
            The detached loss of every microbatch, in order.
        """
        if not self._program.training:
            raise ValueError("step() needs a training program; this one is forward-only, use forward()")
        runners = self._run(self._program, inputs, shared, loss_fn, weight_gradient_hook)
        last = runners[self._program.stage_to_rank[-1]]
        return [last.losses[m] for m in range(self._program.num_microbatches)]

    def forward(self, inputs: Any, *, shared: Any = None) -> list[Any]:
        """Forwards only; returns the last stage's outputs for every microbatch, in order."""
        if self._forward_program is None:
            self._forward_program = forward_only_view(self._program)
        runners = self._run(self._forward_program, inputs, shared, None)
        last = runners[self._program.stage_to_rank[-1]]
        return [last.outputs[m] for m in range(self._program.num_microbatches)]

    def _run(
        self,
        program: PipelineProgram,
        inputs: Any,
        shared: Any,
        loss_fn: LossFn | None,
        weight_hook: WeightGradientHook | None = None,
    ) -> list[RankRunner]:
        microbatches = split_microbatches(inputs, program.num_microbatches)
        spec = spec_of(microbatches[0])
        for s in range(program.num_stages):
            runtime = self._runtimes[s]
            runtime.input_spec = spec
            runtime.output_spec = spec = infer_output_spec(
                stage=s, module=runtime.module, input_spec=spec, shared=shared
            )
        if program.training not in self._runners:
            boxes: dict[tuple[int, Action], list[torch.Tensor]] = {}
            built = [
                RankRunner(
                    program=program,
                    rank=rank,
                    stages={s: self._runtimes[s] for s in program.stages_of(rank)},
                    transport=_Mailbox(rank, boxes),
                    device=self._device,
                )
                for rank in range(program.num_ranks)
            ]
            self._runners[program.training] = (built, boxes)
        runners, boxes = self._runners[program.training]
        boxes.clear()
        for runner in runners:
            runner.start(microbatches=microbatches, shared=shared, loss_fn=loss_fn, weight_hook=weight_hook)
        pointer = [0] * program.num_ranks
        try:
            progressed = True
            while progressed:
                progressed = False
                for rank, acts in enumerate(program.actions):
                    while pointer[rank] < len(acts):
                        action = acts[pointer[rank]]
                        if action.kind.is_recv and (rank, action) not in boxes:
                            break
                        runners[rank].execute(action)
                        pointer[rank] += 1
                        progressed = True
            if any(pointer[r] < len(a) for r, a in enumerate(program.actions)):
                raise RuntimeError(
                    "local pipeline execution stalled (the program was validated; this is a bug)"
                )
            for runner in runners:
                runner.finish()
        except BaseException:
            del self._runners[program.training]  # a failed step may leave state behind
            raise
        finally:
            for runtime in self._runtimes.values():
                runtime.clear()
        return runners
