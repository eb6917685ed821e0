"""The ready-made project config: mesh, trainer, data, optimizer, LR scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.loop._batch_layout import BatchLayout
from d9d.loop.config._data import DataConfig
from d9d.loop.config._lr import ConstantLRSchedulerConfig, LRSchedulerConfig, PiecewiseLRSchedulerConfig
from d9d.loop.config._optimizer import AdamWConfig, OptimizerConfig
from d9d.loop.config._trainer import TrainerConfig
from d9d.mesh import MeshParameters


def check_batch_layout(mesh: MeshParameters, trainer: TrainerConfig) -> None:
    """Raises if the global batch cannot be split over data-parallel ranks and microbatches."""
    BatchLayout.of(mesh, global_batch_size=trainer.global_batch_size, microbatch_size=trainer.microbatch_size)


class ProjectConfig(BaseModel):
    """A whole job's configuration, validated completely at load.

    Subclass it to add your own sections; unknown keys are errors at any depth.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mesh: MeshParameters = MeshParameters()
    trainer: TrainerConfig
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = Field(default_factory=AdamWConfig)
    lr_scheduler: LRSchedulerConfig = Field(default_factory=ConstantLRSchedulerConfig)

    @model_validator(mode="after")
    def _check_batch_layout(self) -> Self:
        check_batch_layout(self.mesh, self.trainer)
        return self

    @model_validator(mode="after")
    def _check_warmup_fits(self) -> Self:
        # with `epochs` the run length is known only once the dataset is: checked when built
        if self.trainer.max_steps is not None and isinstance(self.lr_scheduler, PiecewiseLRSchedulerConfig):
            self.lr_scheduler.check_run_length(self.trainer.max_steps)
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> Self:
        """Loads and validates a YAML file; every error names the file (and the offending keys).

        Raises:
            ConfigFileError: If the file is missing, unreadable, empty, not YAML, not a mapping,
                or does not validate.
        """
        path = Path(path)
        raw = read_config_mapping(path)
        try:
            return cls.model_validate(raw)
        except ValueError as e:
            raise ConfigFileError(f"invalid config {path}:\n{e}") from e


class ConfigFileError(ValueError):
    """A config file could not be loaded; the message names the file."""


def read_config_mapping(path: Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping, not yet validated.

    Raises:
        ConfigFileError: Naming the file, if it is missing, unreadable, binary, empty, not YAML
            or not a mapping.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigFileError(f"cannot read config {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"config {path} is not a text file (byte {e.start} is not UTF-8)") from e
    try:
        raw: Any = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigFileError(f"config {path} is not valid YAML: {e}") from e
    if raw is None:
        raise ConfigFileError(f"config {path} is empty")
    if not isinstance(raw, dict):
        raise ConfigFileError(f"config {path} must be a mapping of sections, not {type(raw).__name__}")
    return cast(dict[str, Any], raw)
