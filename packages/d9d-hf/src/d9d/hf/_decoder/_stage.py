"""Which part of a decoder model one pipeline stage builds."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.pipeline import PipelineStageInfo, layers_of_stage


@dataclass(kw_only=True, frozen=True)
class StageLayout:
    """The part of the model a stage holds.

    Attributes:
        layers: Global indices of its decoder layers.
        is_first: Holds the token embedding.
        is_last: Holds the final norm and the head.
    """

    layers: range
    is_first: bool
    is_last: bool


def stage_layout(num_layers: int, stage: PipelineStageInfo | None, layers: range | None) -> StageLayout:
    """Resolves a stage (None: the whole model) and an optional explicit layer range.

    Raises:
        ValueError: If ``layers`` leaves ``range(num_layers)``.
    """
    stage = stage or PipelineStageInfo(current_stage=0, num_stages=1)
    chosen = layers if layers is not None else layers_of_stage(stage, num_layers)
    if chosen.step != 1 or chosen.start < 0 or chosen.stop > num_layers:
        raise ValueError(f"layers={chosen} is not a contiguous part of range({num_layers})")
    return StageLayout(layers=chosen, is_first=stage.is_first, is_last=stage.is_last)
