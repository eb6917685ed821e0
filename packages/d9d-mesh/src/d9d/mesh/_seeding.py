"""Seeding every random number generator a training job touches."""

from __future__ import annotations

import random

import torch


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
