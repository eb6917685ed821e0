"""What every case of the suite gets: its device, mesh device type, scratch folder and tolerance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from mg_harness import Tolerance
from torch.distributed.device_mesh import DeviceMesh


@dataclass(kw_only=True)
class CaseEnv:
    """One case's surroundings; ``tolerance`` collects the case's largest difference."""

    device: torch.device
    scratch: Path
    tolerance: Tolerance

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """A device mesh over all ranks, on this case's device type."""
        size = 1
        for dim in shape:
            size *= dim
        return DeviceMesh(self.device_type, torch.arange(size).reshape(shape), mesh_dim_names=names)


@dataclass(frozen=True, kw_only=True)
class Case:
    """A named check; ``run`` returns a short detail for the report or raises."""

    name: str
    run: Callable[[CaseEnv], str]
    cuda_only: bool = False
    needs_world: int = 2
