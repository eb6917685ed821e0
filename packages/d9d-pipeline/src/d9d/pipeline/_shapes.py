"""Finding a stage's output shapes without user bookkeeping: a meta-device trial or a Protocol."""

from __future__ import annotations

from itertools import chain
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.func import functional_call

from d9d.pipeline._tree import TreeSpec, spec_of, to_meta


class PipelineShapeError(ValueError):
    """A stage's inputs or outputs do not fit what its neighbour sends or expects."""


@runtime_checkable
class PipelineOutputMeta(Protocol):
    """What a stage module may implement when it cannot run on meta tensors.

    The executor calls it with the stage inputs as meta tensors (and ``shared`` with its tensors on
    the meta device) and sends the returned structure's shapes and dtypes to the next stage.
    """

    def pipeline_output_meta(self, inputs: Any, shared: Any) -> Any:
        """Returns a tree shaped like the stage's outputs (meta tensors are enough)."""
        ...


def call_stage(module: nn.Module, inputs: Any, shared: Any) -> Any:
    """How executors call a stage: ``module(inputs)``, or ``module(inputs, shared)`` with shared data."""
    if shared is None:
        return module(inputs)
    return module(inputs, shared)


def infer_output_spec(*, stage: int, module: nn.Module, input_spec: TreeSpec, shared: Any) -> TreeSpec:
    """The output spec of ``module`` for inputs of ``input_spec``.

    Uses :class:`PipelineOutputMeta` when the module implements it; otherwise runs the module on
    the meta device (its parameters and buffers replaced by meta tensors, nothing computed).

    Raises:
        PipelineShapeError: If the trial fails, naming the stage and the inputs it was given.
    """
    _, meta_inputs = input_spec.empty(torch.device("meta"))
    meta_shared = to_meta(shared) if shared is not None else None
    try:
        with torch.no_grad():
            if isinstance(module, PipelineOutputMeta):
                out = module.pipeline_output_meta(meta_inputs, meta_shared)
            else:
                state = {
                    name: torch.empty_like(t, device="meta")
                    for name, t in chain(module.named_parameters(), module.named_buffers())
                }
                args = (meta_inputs,) if meta_shared is None else (meta_inputs, meta_shared)
                out = functional_call(module, state, args)
    except Exception as e:
        raise PipelineShapeError(
            f"stage {stage}: the trial forward on meta tensors failed for inputs {input_spec.describe()}: "
            f"{type(e).__name__}: {e}. If these are the outputs of stage {stage - 1}, the two stages do not "
            f"fit; if stage {stage} cannot run on the meta device, implement "
            "pipeline_output_meta(inputs, shared)."
        ) from e
    return spec_of(out)


def check_against_spec(*, stage: int, what: str, tree: Any, expected: TreeSpec) -> None:
    """Raises if ``tree`` does not have ``expected``'s structure, shapes and dtypes.

    Raises:
        PipelineShapeError: Naming the stage and the first differing path.
    """
    got = spec_of(tree)
    if got == expected:
        return
    if got.skeleton != expected.skeleton:
        raise PipelineShapeError(
            f"stage {stage}: {what} have structure {got.describe()}, expected {expected.describe()}"
        )
    for path, g, e in zip(got.paths, got.tensors, expected.tensors, strict=True):
        if g != e:
            raise PipelineShapeError(
                f"stage {stage}: {what} tensor '{path}' is {tuple(g.shape)} {g.dtype}, expected "
                f"{tuple(e.shape)} {e.dtype} (from the trial run; did its shape depend on values?)"
            )
