"""Several trackers written to side by side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from d9d.loop.config._trainer import TrackerConfig
from d9d.loop.observability._trackers import NoTracker, Tracker, build_tracker


class TrackerGroup:
    """Forwards every call to each tracker; its state holds each tracker's state by name.

    Names are the trackers' config names (``tensorboard``, ``wandb``), numbered when one
    repeats; a checkpoint of a run with other trackers restores those with matching names.
    """

    def __init__(self, trackers: Sequence[tuple[str, Tracker]]) -> None:
        self._trackers: dict[str, Tracker] = {}
        for name, tracker in trackers:
            key, index = name, 1
            while key in self._trackers:
                key, index = f"{name}_{index}", index + 1
            self._trackers[key] = tracker

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker in self._trackers.values():
            tracker.log(step, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {name: tracker.state_dict() for name, tracker in self._trackers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, tracker in self._trackers.items():
            if name in state:
                tracker.load_state_dict(state[name])

    def on_resume(self, step: int) -> None:
        for tracker in self._trackers.values():
            tracker.on_resume(step)

    def close(self) -> None:
        """Closes every tracker, then raises the first error any of them raised."""
        errors: list[Exception] = []
        for tracker in self._trackers.values():
            try:
                tracker.close()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


def build_trackers(configs: Sequence[TrackerConfig], *, metadata: Mapping[str, Any]) -> Tracker:
    """The tracker of ``configs``: none, the one, or a group of them."""
    match configs:
        case []:
            return NoTracker()
        case [config]:
            return build_tracker(config, metadata=metadata)
        case _:
            return TrackerGroup([(c.name, build_tracker(c, metadata=metadata)) for c in configs])
