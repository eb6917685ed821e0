"""Aim (extra ``aim``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from d9d.loop._optional_import import import_extra
from d9d.loop.config._trackers import AimTrackerConfig


class AimTracker:
    """Tracks metrics in one Aim run; the run's metadata is stored under ``run["d9d"]``.

    State: the run hash, so a resumed job continues the same run. Aim keeps every tracked value,
    so values of steps re-run after a resume appear once per run of them.
    """

    def __init__(self, config: AimTrackerConfig, *, metadata: Mapping[str, Any]) -> None:
        self._aim = import_extra("aim", extra="aim", feature="the aim tracker")
        self._config = config
        self._metadata = dict(metadata)
        self._run_hash: str | None = None
        self._run: Any = None

    def _open(self) -> Any:
        if self._run is None:
            config = self._config
            run = self._aim.Run(run_hash=self._run_hash, repo=config.repo, experiment=config.experiment)
            if self._run_hash is None:
                if config.run_name is not None:
                    run.name = config.run_name
                run["d9d"] = self._metadata
            self._run_hash = str(run.hash)
            self._run = run
        return self._run

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        run = self._open()
        for name, value in metrics.items():
            run.track(value, name=name, step=step)

    def state_dict(self) -> dict[str, Any]:
        if self._run_hash is None:
            self._open()  # a checkpoint before the first log still names the run
        return {"run_hash": self._run_hash}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("run_hash") is not None:
            self._run_hash = str(state["run_hash"])

    def on_resume(self, step: int) -> None:
        del step  # Aim cannot forget tracked values; see the class docstring

    def close(self) -> None:
        if self._run is not None:
            self._run.close()
            self._run = None
