"""How a model stage may state its outputs when its forward cannot run on meta tensors."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class StageOutputMeta(Protocol):
    """Optional method of a model stage: its outputs for inputs given as meta tensors.

    Before a pipelined step, the loop learns each stage's output shapes and dtypes from a
    meta-device copy of the stage. By default it runs that copy's ``forward(inputs, shared)``; a
    stage whose forward needs real values (data-dependent shapes, such as MoE token counts)
    implements this instead. ``inputs`` is in the form ``forward`` takes (the first stage's
    ``Input`` rebuilt from its microbatch), with meta tensors.
    """

    def pipeline_output_meta(self, inputs: Any, shared: Any) -> Any:
        """A tree shaped like ``forward(inputs, shared)``'s output (meta tensors are enough)."""
        ...
