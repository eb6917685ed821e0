"""Configuration of the trackers that live in optional extras: TensorBoard, W&B, Aim."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _non_empty(value: str) -> str:
    if not value.strip():
        raise ValueError("an empty value is not allowed")
    return value


_Name = Annotated[str, AfterValidator(_non_empty)]


class _TrackerBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorBoardTrackerConfig(_TrackerBase):
    """Write TensorBoard event files (extra ``d9d-loop[tensorboard]``).

    Attributes:
        directory: The log root (``tensorboard --logdir`` points here).
        run_name: The run's sub-directory; None: the start time. A resumed run keeps writing
            to the sub-directory it started in.
    """

    name: Literal["tensorboard"] = "tensorboard"
    directory: Path
    run_name: _Name | None = None


class WandbTrackerConfig(_TrackerBase):
    """Log to Weights & Biases (extra ``d9d-loop[wandb]``); a resumed run continues its run id.

    Attributes:
        project: The W&B project.
        entity: The team or user (None: the logged-in user's default).
        run_name: The run's display name (None: W&B picks one).
        mode: ``online``, ``offline`` (files under ``directory``, ``wandb sync`` later) or
            ``disabled``.
        directory: Where W&B keeps its local files (None: the working directory).
        tags: Tags of the run.
    """

    name: Literal["wandb"] = "wandb"
    project: _Name
    entity: _Name | None = None
    run_name: _Name | None = None
    mode: Literal["online", "offline", "disabled"] = "online"
    directory: Path | None = None
    tags: list[str] = Field(default_factory=list[str])


class AimTrackerConfig(_TrackerBase):
    """Log to an Aim repository (extra ``d9d-loop[aim]``); a resumed run continues its run hash.

    Attributes:
        repo: The repository: a local path or an ``aim://host:port`` address.
        experiment: The experiment the run belongs to (None: Aim's default).
        run_name: The run's display name.
    """

    name: Literal["aim"] = "aim"
    repo: _Name
    experiment: _Name | None = None
    run_name: _Name | None = None
