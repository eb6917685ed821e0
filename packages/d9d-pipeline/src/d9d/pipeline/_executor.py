"""Runs a program over the pipeline process group with batched asynchronous point-to-point ops."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from d9d.pipeline._executor_base import check_stage_modules, forward_only_view
from d9d.pipeline._program import PipelineProgram
from d9d.pipeline._runner import RankRunner
from d9d.pipeline._shapes import PipelineShapeError, infer_output_spec
from d9d.pipeline._sharded_backward import warn_whole_backward, whole_backward_stages
from d9d.pipeline._stage_runtime import LossFn, StageRuntime, WeightGradientHook
from d9d.pipeline._transport import P2PTransport
from d9d.pipeline._tree import TreeSpec, spec_of, split_microbatches
from d9d.pipeline._validator import validate_program


@dataclass(frozen=True)
class _SeenShapes:
    """What one rank compares between steps to decide whether the shapes must be exchanged again."""

    first: TreeSpec | None  # the first microbatch's spec, on the rank of stage 0
    shared: TreeSpec | None


def _same(a: _SeenShapes, b: _SeenShapes) -> bool:
    """``a == b``, False where comparing the trees' constant leaves fails (e.g. arrays)."""
    try:
        return bool(a == b)
    except Exception:
        return False


class PipelineExecutor:
    """Runs a :class:`PipelineProgram` on this rank's stages, talking to the other pipeline ranks.

    Every rank of the pipeline group builds one executor with the same program and its own stages,
    and calls :meth:`step` (training) or :meth:`forward` (inference) with the same arguments at the
    same time. Before the first point-to-point op of a step, the ranks pass their stages' output
    shapes down the pipeline (found by a meta-device trial forward, or by the stage's
    ``pipeline_output_meta``; cached per input shape), so shapes may change between steps, and a
    stage whose outputs do not fit the next stage fails on every rank with the same error. That
    exchange runs only when something a rank sees has changed since the last successful one (the
    first microbatch's structure, shapes and dtypes on the rank of stage 0, the ``shared`` tree's
    on every rank, or a batch that does not split); otherwise the step starts with one all-reduce
    of a flag on which the ranks agree to skip it.

    Stages are called as ``module(inputs)``, or ``module(inputs, shared)`` when ``shared`` is given.
    Stage inputs and outputs are pytrees (tensors, dicts, lists, tuples); gradients travel back for
    their floating-point tensors. Parameter gradients accumulate in ``.grad`` over microbatches (the
    executor never zeroes them). On a stage holding FSDP (``fully_shard``) modules whose backward
    the program splits (``I`` and ``W``), FSDP's gradient reduction is held back during the step
    and runs once per parameter group after the stage's last ``W``, parameters gathered for every
    ``W`` (see :mod:`d9d.pipeline._sharded_backward`; on a torch without
    ``FSDPModule.finalize_backward`` such a stage runs its backward whole in ``I``, with a warning).

    Args:
        program: The program, the same on every rank (validated here).
        stages: This rank's stage modules by stage index; exactly the stages the program places here.
        group: The pipeline process group; the default group when None. Program rank ``r`` is the
            group's rank ``r``.
        device: Where receive buffers live; the device of the stages' first parameter when None.

    Raises:
        ValueError: If the group size differs from the program's rank count or the stages are not
            this rank's stages under the program.
        PipelineProgramError: If the program is invalid.
    """

    def __init__(
        self,
        program: PipelineProgram,
        stages: Mapping[int, nn.Module],
        *,
        group: ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        resolved = group if group is not None else dist.group.WORLD
        if resolved is None:
            raise RuntimeError("PipelineExecutor needs an initialized torch.distributed process group")
        self._group: ProcessGroup = resolved
        world = dist.get_world_size(self._group)
        if world != program.num_ranks:
            raise ValueError(
                f"the program is for {program.num_ranks} ranks but the pipeline group has {world}"
            )
        self._rank = dist.get_rank(self._group)
        check_stage_modules(program, self._rank, stages)
        validate_program(program)
        self._whole_backward = frozenset(whole_backward_stages(program, self._rank, stages))
        warn_whole_backward(sorted(self._whole_backward))
        self._program = program
        self._global = [dist.get_global_rank(self._group, r) for r in range(world)]
        if device is None:
            param = next((p for m in stages.values() for p in m.parameters()), None)
            device = param.device if param is not None else torch.device("cpu")
        self._device = device
        self._runtimes = {
            s: StageRuntime(stage=s, num_stages=program.num_stages, module=m) for s, m in stages.items()
        }
        self._spec_cache: dict[int, list[tuple[TreeSpec, TreeSpec]]] = {}
        # What this rank saw at the last successful shape exchange (None: exchange next step).
        self._exchanged: _SeenShapes | None = None
        self._flag = torch.zeros(1, dtype=torch.int64, device=device)
        self._forward_program: PipelineProgram | None = None
        # One runner (and transport) per program, reused by every step: built once, reset by start().
        self._runners: dict[bool, RankRunner] = {}

    @property
    def program(self) -> PipelineProgram:
        """The program this executor runs."""
        return self._program

    @property
    def rank(self) -> int:
        """This rank in the pipeline group."""
        return self._rank

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank holds the last stage (where losses and outputs appear)."""
        return self._program.num_stages - 1 in self._runtimes

    def step(
        self,
        inputs: Any,
        *,
        loss_fn: LossFn,
        shared: Any = None,
        weight_gradient_hook: WeightGradientHook | None = None,
    ) -> list[torch.Tensor] | None:
        """Runs forward and backward of every microbatch of ``inputs``.

        Args:
            inputs: The batch pytree; split into ``program.num_microbatches`` pieces along tensor
                dim 0 (needed on the rank of stage 0; other ranks may pass the same batch or None).
            loss_fn: On the last stage, ``(outputs, microbatch_index) -> loss``: a one-element
                tensor, already weighted (for a mean over the batch, divide by the microbatch count
                or by the batch's token count); its backward is what the step runs.
            shared: Passed unchanged to every stage on every microbatch (rotary tables, masks).
            weight_gradient_hook: ``hook(stage, microbatch, is_last)`` before each action that
                accumulates a local stage's parameter gradients; ``is_last`` marks the stage's last
                one of the step (where a gradient synchronizer should reduce).

        Returns:
            On the rank holding the last stage, the detached loss of every microbatch in order;
            None on other ranks.
        """
        if not self._program.training:
            raise ValueError("step() needs a training program; this one is forward-only, use forward()")
        runner = self._run(self._program, inputs, shared, loss_fn, weight_gradient_hook)
        if not self.has_last_stage:
            return None
        return [runner.losses[m] for m in range(self._program.num_microbatches)]

    def forward(self, inputs: Any, *, shared: Any = None) -> list[Any] | None:
        """Runs the forwards only, without autograd (inference).

        A training program runs as its forward-only view (the same forwards in the same order).

        Returns:
            On the rank holding the last stage, the last stage's outputs for every microbatch in
            order; None on other ranks.
        """
        if self._forward_program is None:
            self._forward_program = forward_only_view(self._program)
        runner = self._run(self._forward_program, inputs, shared, None)
        if not self.has_last_stage:
            return None
        return [runner.outputs[m] for m in range(self._program.num_microbatches)]

    def _run(
        self,
        program: PipelineProgram,
        inputs: Any,
        shared: Any,
        loss_fn: LossFn | None,
        weight_hook: WeightGradientHook | None = None,
    ) -> RankRunner:
        microbatches: list[Any] = []
        input_error: str | None = None
        if 0 in self._runtimes:
            try:
                microbatches = split_microbatches(inputs, program.num_microbatches)
            except ValueError as e:  # reported on every rank by the shape exchange
                input_error = f"the batch does not split into microbatches: {e}"
        self._agree_on_shapes(microbatches[0] if microbatches else None, shared, input_error)
        runner = self._runners.get(program.training)
        if runner is None:
            runner = RankRunner(
                program=program,
                rank=self._rank,
                stages=self._runtimes,
                transport=P2PTransport(group=self._group, global_ranks=self._global),
                device=self._device,
                whole_backward=self._whole_backward,
            )
            self._runners[program.training] = runner
        runner.start(microbatches=microbatches, shared=shared, loss_fn=loss_fn, weight_hook=weight_hook)
        try:
            for action in program.actions[self._rank]:
                runner.execute(action)
            runner.finish()
        except BaseException:
            # A failed step may leave posted ops in the transport and specs that did not hold:
            # the next step starts with a new runner and exchanges the shapes again.
            del self._runners[program.training]
            self._exchanged = None
            raise
        finally:
            for runtime in self._runtimes.values():
                runtime.clear()
        return runner

    def _output_spec(self, stage: int, input_spec: TreeSpec, shared: Any) -> TreeSpec:
        cache = self._spec_cache.setdefault(stage, [])
        for known_in, known_out in cache:
            if known_in == input_spec:
                return known_out
        out = infer_output_spec(
            stage=stage, module=self._runtimes[stage].module, input_spec=input_spec, shared=shared
        )
        cache.insert(0, (input_spec, out))
        del cache[8:]
        return out

    def _agree_on_shapes(self, first_microbatch: Any, shared: Any, input_error: str | None) -> None:
        """Runs :meth:`_exchange_shapes` when any rank sees a change since the last successful one.

        Each rank compares what it sees (on the rank of stage 0 the first microbatch's spec and any
        batch-split error; on every rank the spec of ``shared``) with what it saw at the last
        successful exchange; one all-reduce (max) of a 0/1 flag over the pipeline group makes every
        rank take the same branch. A failed exchange forgets what was seen, so the next step
        exchanges again.

        Raises:
            PipelineShapeError: As :meth:`_exchange_shapes`.
        """
        seen: _SeenShapes | None = None
        if input_error is None:
            seen = _SeenShapes(
                first=spec_of(first_microbatch) if 0 in self._runtimes else None,
                shared=None if shared is None else spec_of(shared),
            )
        changed = seen is None or self._exchanged is None or not _same(seen, self._exchanged)
        self._flag.fill_(int(changed))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        if not self._flag.item():
            return
        self._exchanged = None
        self._exchange_shapes(first_microbatch, shared, input_error)
        self._exchanged = seen

    def _exchange_shapes(self, first_microbatch: Any, shared: Any, input_error: str | None) -> None:
        """Passes output specs down the pipeline in stage order; every rank learns of any failure.

        Raises:
            PipelineShapeError: On every rank, if the batch could not be split or a stage's
                outputs do not fit the next stage.
        """
        where = self._program.stage_to_rank
        error: str | None = None
        for s in sorted(self._runtimes):
            runtime = self._runtimes[s]
            spec: TreeSpec | str | None
            if s == 0:
                spec = input_error if input_error is not None else spec_of(first_microbatch)
            elif where[s - 1] == self._rank:
                spec = self._runtimes[s - 1].output_spec if error is None else error
            else:
                box: list[Any] = [None]
                dist.recv_object_list(
                    box, src=self._global[where[s - 1]], group=self._group, device=self._device
                )
                spec = box[0]
            out: TreeSpec | str
            if isinstance(spec, TreeSpec):
                runtime.input_spec = spec
                try:
                    out = self._output_spec(s, spec, shared)
                    runtime.output_spec = out
                except PipelineShapeError as e:
                    out = error = str(e)
            else:
                out = error = spec if isinstance(spec, str) else f"stage {s}: no input spec"
            if s + 1 < self._program.num_stages and where[s + 1] != self._rank:
                dist.send_object_list(
                    [out], dst=self._global[where[s + 1]], group=self._group, device=self._device
                )
        errors: list[Any] = [None] * self._program.num_ranks
        dist.all_gather_object(errors, error, group=self._group)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise PipelineShapeError(first)
