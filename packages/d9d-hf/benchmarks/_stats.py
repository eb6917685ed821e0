"""How the benchmarks print a figure measured several times: ``median (min-max)``."""

from __future__ import annotations

import statistics


def spread(values: list[float], digits: int = 2) -> str:
    """``median (min-max)`` of ``values`` with ``digits`` decimals; one value alone, ``-`` for none."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
