"""Configuration of what watches a run: the profiler window and garbage-collection control."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ProfilingConfig(BaseModel):
    """Run ``torch.profiler`` for a window of steps and write one Chrome trace per chosen rank.

    Attributes:
        start_step: The first profiled step (0-based, as the trainer counts steps).
        steps: How many steps the window holds.
        ranks: The global ranks that profile (``all`` for every rank).
        record_shapes: Record operator input shapes.
        memory: Record allocations in the trace (``profile_memory``); on CUDA also write the
            caching allocator's snapshot at the window's end.
        directory: Where traces go: ``rank{R}_steps{A}-{B}.json`` (open in Perfetto or
            chrome://tracing).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    start_step: int = Field(default=0, ge=0)
    steps: int = Field(default=1, ge=1)
    ranks: list[int] | Literal["all"] = Field(default_factory=lambda: [0])
    record_shapes: bool = False
    memory: bool = False
    directory: Path = Path("profiles")

    def profiles_rank(self, rank: int) -> bool:
        """Whether ``rank`` profiles."""
        return self.ranks == "all" or rank in self.ranks


class GarbageCollectionConfig(BaseModel):
    """Python's automatic garbage collection off during training, a collection every N steps.

    An automatic collection starts whenever allocation counts say so, at a different moment on
    every rank: one slow rank stalls every collective. Collecting at the same step everywhere
    keeps ranks in step. A full automatic collection in a process holding a compiled model walks
    millions of objects: on one H200, with this off, one step of an 8B LoRA job took 1.2 s
    instead of 0.38 s in two runs of three (measured); a collection is the likely cause (not
    confirmed there).
    On by default; ``garbage_collection: null`` restores Python's automatic collection.

    Attributes:
        every_steps: Collect after every this many steps (young objects only by default, so
            the cyclic garbage of a few dozen steps, which may hold device tensors, is freed
            cheaply).
        generation: The oldest generation collected (2 is a full collection).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    every_steps: int = Field(default=50, ge=1)
    generation: Literal[0, 1, 2] = 1
