"""Counts of what the data pipeline changed or left out, reported once the data is read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

OverlongPolicy = Literal["truncate", "drop"]
"""What happens to a sample longer than a row: cut to the row's length, or left out."""


@dataclass(kw_only=True)
class DataReport:
    """How many samples were read, truncated, dropped (too long) or skipped (unusable).

    Attributes:
        samples: Samples that made it into rows.
        truncated: Samples cut to ``sequence_length``.
        dropped: Samples left out for being longer than ``sequence_length``.
        skipped: Samples left out because they could not be used (a missing field, say).
        examples: The first few ``where: why`` lines of truncated, dropped and skipped samples.
    """

    samples: int = 0
    truncated: int = 0
    dropped: int = 0
    skipped: int = 0
    examples: list[str] = field(default_factory=list[str])

    def note(self, line: str) -> None:
        """Keeps ``line`` among the first few examples."""
        if len(self.examples) < 5:
            self.examples.append(line)

    def summary(self, source: str) -> str:
        """One line for the log, with the first examples on following lines."""
        text = (
            f"{source}: {self.samples} samples used, {self.truncated} truncated, "
            f"{self.dropped} dropped as too long, {self.skipped} skipped"
        )
        return "\n  ".join([text, *self.examples])
