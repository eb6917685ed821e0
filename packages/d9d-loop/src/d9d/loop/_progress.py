"""The progress bar of the main rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from tqdm import tqdm


class ProgressBar:
    """A tqdm bar over optimizer steps showing the latest metrics; does nothing when disabled."""

    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        self._bar: tqdm[NoReturn] | None = None
        if enabled:
            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, metrics: Mapping[str, float]) -> None:
        """Advances one step and shows ``metrics``."""
        if self._bar is None:
            return
        self._bar.set_postfix({k: _short(v) for k, v in metrics.items()}, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        """Closes the bar."""
        if self._bar is not None:
            self._bar.close()


def _short(value: float) -> str:
    return f"{value:.4g}"
