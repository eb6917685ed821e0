"""A compute action placed on a simulated timeline."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.pipeline._actions import Action


@dataclass(frozen=True, kw_only=True)
class TimedAction:
    """A compute action placed on the timeline."""

    action: Action
    rank: int
    start: float
    end: float
