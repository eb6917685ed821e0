"""What a model builder needs to know to build one pipeline stage, and the layer split."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineStageInfo:
    """The stage a model builder is asked to build.

    Attributes:
        current_stage: Index of the stage, 0 for the stage that takes the batch.
        num_stages: Total number of stages of the pipeline (over all ranks).
    """

    current_stage: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if not 0 <= self.current_stage < self.num_stages:
            raise ValueError(
                f"current_stage={self.current_stage} is outside [0, num_stages={self.num_stages})"
            )

    @property
    def is_first(self) -> bool:
        """Whether this stage takes the batch (holds, say, the embedding)."""
        return self.current_stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage produces the outputs the loss reads (holds, say, the head)."""
        return self.current_stage == self.num_stages - 1


def assign_layers(
    num_layers: int,
    num_stages: int,
    *,
    first_stage_weight: float = 0.0,
    last_stage_weight: float = 0.0,
) -> list[range]:
    """Splits ``num_layers`` layers into contiguous ranges, one per stage, balancing cost.

    Every layer costs 1; the first stage carries an extra ``first_stage_weight`` (an embedding, say)
    and the last stage an extra ``last_stage_weight`` (a head and the loss). Stage boundaries are
    placed where the running cost is nearest to an equal share, so with weights 0 the split is even
    (earlier stages take the remainder layers).

    Args:
        num_layers: Number of repeated layers (transformer blocks, say).
        num_stages: Number of pipeline stages.
        first_stage_weight: Extra cost of the first stage, in layers.
        last_stage_weight: Extra cost of the last stage, in layers.

    Returns:
        ``num_stages`` ranges covering ``range(num_layers)`` in order; a range may be empty when a
        stage's extra weight is worth all its share.

    Raises:
        ValueError: If a count is not positive or a weight is negative.
    """
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if first_stage_weight < 0 or last_stage_weight < 0:
        raise ValueError(
            f"stage weights must be >= 0, got first_stage_weight={first_stage_weight}, "
            f"last_stage_weight={last_stage_weight}"
        )
    if first_stage_weight == 0 and last_stage_weight == 0:
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
    else:
        share = (num_layers + first_stage_weight + last_stage_weight) / num_stages
        bounds = [0]
        for i in range(1, num_stages):
            ideal = round(i * share - first_stage_weight)
            bounds.append(min(max(ideal, bounds[-1]), num_layers))
        bounds.append(num_layers)
        sizes = [bounds[i + 1] - bounds[i] for i in range(num_stages)]
    ranges: list[range] = []
    start = 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def layers_of_stage(
    stage: PipelineStageInfo,
    num_layers: int,
    *,
    first_stage_weight: float = 0.0,
    last_stage_weight: float = 0.0,
) -> range:
    """The layer indices that ``stage`` builds; see :func:`assign_layers`."""
    return assign_layers(
        num_layers,
        stage.num_stages,
        first_stage_weight=first_stage_weight,
        last_stage_weight=last_stage_weight,
    )[stage.current_stage]
