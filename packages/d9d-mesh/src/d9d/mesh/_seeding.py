"""Seeding every random number generator a training job touches."""

from __future__ import annotations

import random

import torch

_STREAM_STRIDE = 1_000_003  # a prime well above any stage or epoch count: streams never overlap


def derived_seed(seed: int, stream: int) -> int:
    """The seed of one of several independent random streams drawn from one run seed.

    Used for per-pipeline-stage model initialization and per-epoch data shuffling, so that no two
    streams of a run (nor of two runs with nearby seeds) start from the same seed.

    Args:
        seed: The run's seed.
        stream: Which stream (a pipeline stage, an epoch).
    """
    return seed + _STREAM_STRIDE * stream


def seed_everything(seed: int) -> None:
    """Seeds Python's ``random``, torch (CPU and every CUDA device) and numpy when installed.

    DTensor's random ops draw their seed from torch's default generator the first time they run,
    so seeding torch identically on the ranks of one mesh keeps DTensor initialization consistent.

    Args:
        seed: The seed; must fit in 32 bits for numpy.
    """
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)
