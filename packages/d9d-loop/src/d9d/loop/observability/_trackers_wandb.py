"""Weights & Biases (extra ``wandb``)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from d9d.loop._optional_import import import_extra
from d9d.loop.config._trackers import WandbTrackerConfig


class WandbTracker:
    """Logs to one W&B run; the run's metadata is its config.

    State: the run id, so a resumed job continues the same run (``resume="allow"``). W&B keeps
    steps increasing: values of steps re-run after a resume that the run already holds are
    dropped by W&B (the first values stay).
    """

    def __init__(self, config: WandbTrackerConfig, *, metadata: Mapping[str, Any]) -> None:
        self._wandb = import_extra("wandb", extra="wandb", feature="the wandb tracker")
        self._config = config
        self._metadata = dict(metadata)
        self._run_id = secrets.token_hex(6)  # W&B run ids: letters and digits
        self._run: Any = None

    @property
    def run_id(self) -> str:
        """The W&B run id (saved in checkpoints)."""
        return self._run_id

    def _open(self) -> Any:
        if self._run is None:
            config = self._config
            directory = config.directory
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
            self._run = self._wandb.init(
                project=config.project,
                entity=config.entity,
                name=config.run_name,
                mode=config.mode,
                dir=str(directory) if directory is not None else None,
                tags=list(config.tags),
                id=self._run_id,
                resume="allow",
                config=self._metadata,
            )
        return self._run

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._open().log(dict(metrics), step=step)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self._run_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "run_id" in state:
            self._run_id = str(state["run_id"])

    def on_resume(self, step: int) -> None:
        del step  # W&B cannot forget logged steps; see the class docstring

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
