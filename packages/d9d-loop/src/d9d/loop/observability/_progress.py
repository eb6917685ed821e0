"""The progress bar of the main rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from tqdm import tqdm

# What the bar shows, in this order (every metric still goes to the trackers): the bar is read at
# a glance, so timing splits, memory and task metrics stay out of it unless named here.
BAR_METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "mfu", "memory/peak_gib")


class ProgressBar:
    """A tqdm bar over optimizer steps showing the key metrics; does nothing when disabled."""

    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        self._bar: tqdm[NoReturn] | None = None
        if enabled:
            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, metrics: Mapping[str, float]) -> None:
        """Advances one step and shows ``metrics``."""
        if self._bar is None:
            return
        shown = {k: _short(metrics[k]) for k in BAR_METRICS if k in metrics}
        if "tokens_per_s" in shown:
            shown.pop("samples_per_s", None)
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        """Closes the bar."""
        if self._bar is not None:
            self._bar.close()


def _short(value: float) -> str:
    return f"{value:.4g}"
