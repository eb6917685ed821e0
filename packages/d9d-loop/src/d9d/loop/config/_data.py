"""Data loading configuration."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DataConfig(BaseModel):
    """How ``AutoDataProvider`` reads a map-style dataset.

    Attributes:
        shuffle: Visit samples in a seeded random order, a new one each epoch.
        seed: Seed of the sample order (the same on every rank).
        num_workers: ``torch.utils.data.DataLoader`` worker processes per rank (0 = main process).
        pin_memory: Pin host memory for faster copies to CUDA.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    shuffle: bool = True
    seed: int = 0
    num_workers: int = Field(default=0, ge=0)
    pin_memory: bool = False
