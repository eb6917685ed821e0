"""Progress bars: shown on the main rank only, and only when stderr is a terminal."""

from __future__ import annotations

from typing import NoReturn

import torch.distributed as dist
from tqdm import tqdm


def is_main_rank() -> bool:
    """Whether this process is rank 0 of the default group (or not distributed at all)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def byte_progress(total: int, description: str, *, show: bool) -> tqdm[NoReturn]:
    """A byte-counting bar; ``disable=None`` lets tqdm hide it when stderr is not a terminal."""
    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=None if show and is_main_rank() else True,
        leave=False,
    )
