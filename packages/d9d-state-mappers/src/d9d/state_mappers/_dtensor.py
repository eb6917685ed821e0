"""Moving between full tensors and DTensors: distribute to placements, gather from them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from d9d.state_mappers._local_box import local_box
from d9d.state_mappers._spec import Box, TensorPiece, TensorSpec, full_box
from d9d.state_mappers._unary import UnaryMapper


class DistributeMapper(UnaryMapper):
    """Turns full tensor ``source`` into a DTensor laid out by ``placements`` on ``mesh``.

    Each rank reads only its own box of the source and wraps it (no communication). Supports
    ``Shard`` and ``Replicate`` placements. The output is always produced whole (a DTensor), so
    it cannot be requested in slices.
    """

    def __init__(
        self, source: str, mesh: DeviceMesh, placements: Sequence[Placement], *, target: str | None = None
    ) -> None:
        super().__init__(source, target)
        self._mesh = mesh
        self._placements = tuple(placements)

    def infer_one(self, spec: TensorSpec) -> TensorSpec:
        if local_box(spec.shape, self._mesh, self._placements) is None:
            raise ValueError(
                f"distribute of {self.source!r}: placements {list(self._placements)} are not plain "
                f"Shard/Replicate, or this rank is not in the mesh"
            )
        return spec

    def input_box(self, out_box: Box, in_spec: TensorSpec) -> Box:
        if out_box != full_box(in_spec.shape):
            raise ValueError(
                f"distribute of {self.source!r} produces a whole DTensor; got a request for {out_box}"
            )
        box = local_box(in_spec.shape, self._mesh, self._placements)
        if box is None:
            raise ValueError(
                f"distribute of {self.source!r}: placements {list(self._placements)} unsupported"
            )
        return box

    def compute(self, data: torch.Tensor, in_spec: TensorSpec, in_box: Box, out_box: Box) -> torch.Tensor:
        contiguous = torch.empty(in_spec.shape, dtype=in_spec.dtype, device="meta").stride()
        return DTensor.from_local(
            data.contiguous(),
            self._mesh,
            self._placements,
            run_check=False,
            shape=torch.Size(in_spec.shape),
            stride=contiguous,
        )


class GatherMapper(UnaryMapper):
    """Turns DTensor ``source`` into a full tensor on every rank (a collective over its mesh).

    A plain tensor passes through unchanged.
    """

    def infer_one(self, spec: TensorSpec) -> TensorSpec:
        return spec

    def input_box(self, out_box: Box, in_spec: TensorSpec) -> Box:
        return full_box(in_spec.shape)

    def compute(self, data: torch.Tensor, in_spec: TensorSpec, in_box: Box, out_box: Box) -> torch.Tensor:
        full = data.full_tensor() if isinstance(data, DTensor) else data
        return TensorPiece(data=full, box=in_box).narrow(out_box)
