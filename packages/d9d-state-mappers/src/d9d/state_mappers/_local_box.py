"""Which box of the global tensor a rank holds under a DTensor layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from d9d.state_mappers._spec import Box, full_box


def local_box(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> Box | None:
    """The box this rank holds of a tensor of global ``shape`` laid out by ``placements`` on ``mesh``.

    Shards follow ``torch.chunk`` (as DTensor's ``Shard`` does): a tensor dim of size ``n`` split
    ``k`` ways gives chunks of ``ceil(n / k)``, the last ones smaller or empty; several mesh dims
    sharding one tensor dim split it left to right.

    Returns:
        The box, or None when the layout is not a plain box: a placement other than ``Shard`` and
        ``Replicate`` (``Partial``, strided shards) or a rank outside the mesh.
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    box: list[tuple[int, int]] = list(full_box(shape))
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or type(placement) is not Shard:
            return None
        dim = cast(int, placement.dim) % len(shape)
        start, stop = box[dim]
        size = stop - start
        parts = int(mesh.size(mesh_dim))
        chunk = -(-size // parts)
        lo = min(coordinate[mesh_dim] * chunk, size)
        hi = min(lo + chunk, size)
        box[dim] = (start + lo, start + hi)
    return tuple(box)
