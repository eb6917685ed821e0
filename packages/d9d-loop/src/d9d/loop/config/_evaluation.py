"""Evaluation during training: how often, and which result counts as the best."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class BestEvaluationConfig(BaseModel):
    """Which evaluation result is the best so far, and whether reaching it saves a checkpoint.

    Attributes:
        metric: A reported name, e.g. ``eval/loss`` or ``eval/auroc``.
        mode: ``min`` (a loss) or ``max`` (AUROC, F1, accuracy).
        checkpoint: Save a checkpoint at every step whose evaluation improved on the best
            (needs ``trainer.checkpoint.directory``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str = "eval/loss"
    mode: Literal["min", "max"] = "min"
    checkpoint: bool = True


class EvaluationConfig(BaseModel):
    """A forward-only pass over held-out data during training (``TrainingConfigurator(evaluation_data=...)``).

    Every sample of the held-out set counts exactly once over all ranks; the loss is the
    ``loss_weight``-weighted mean over samples (a microbatch without a weight weighs its sample
    count), metrics are the task's ``evaluation`` metrics. No gradients, no optimizer state.

    Attributes:
        every_steps: Evaluate after every this many optimizer steps.
        at_end: Also evaluate after the last step.
        best: Track the best result (None: do not).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    every_steps: int = Field(ge=1)
    at_end: bool = True
    best: BestEvaluationConfig | None = None
