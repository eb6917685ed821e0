"""TensorBoard event files through ``torch.utils.tensorboard`` (extra ``tensorboard``)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from d9d.loop._optional_import import import_extra
from d9d.loop.config._trackers import TensorBoardTrackerConfig


class TensorBoardTracker:
    """Writes scalars to ``directory/run_name``; the run's metadata goes in as a text summary.

    State: the run name, so a resumed run writes to the same directory; on resume the events of
    the resumed step and later are purged (``SummaryWriter(purge_step=...)``), so re-run steps are
    not shown twice.
    """

    def __init__(self, config: TensorBoardTrackerConfig, *, metadata: Mapping[str, Any]) -> None:
        # imported now, so a missing extra fails when the job is configured, not at the first log
        self._module = import_extra(
            "torch.utils.tensorboard", extra="tensorboard", feature="the tensorboard tracker"
        )
        self._config = config
        self._metadata = dict(metadata)
        self._run_name = config.run_name or time.strftime("%Y%m%d-%H%M%S")
        self._purge_step: int | None = None
        self._writer: Any = None

    @property
    def log_dir(self) -> str:
        """The run's directory."""
        return str(self._config.directory / self._run_name)

    def _open(self) -> Any:
        if self._writer is None:
            self._writer = self._module.SummaryWriter(log_dir=self.log_dir, purge_step=self._purge_step)
            text = json.dumps(self._metadata, indent=2, sort_keys=True)
            self._writer.add_text("run_metadata", f"```json\n{text}\n```", global_step=self._purge_step or 0)
        return self._writer

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        writer = self._open()
        for name, value in metrics.items():
            writer.add_scalar(name, value, global_step=step)

    def state_dict(self) -> dict[str, Any]:
        return {"run_name": self._run_name}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "run_name" in state:
            self._run_name = str(state["run_name"])

    def on_resume(self, step: int) -> None:
        self.close()  # the next write reopens the run, purging events of ``step`` and later
        self._purge_step = step

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
