"""Checks and look-ups of named mesh dims shared by the ``parallelize_*`` functions.

Vocabulary: a *mesh dim* is a named axis of a ``DeviceMesh``; a *tensor dim* is an index into a
tensor's shape.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh


def mesh_dim_names(mesh: DeviceMesh, *, purpose: str) -> tuple[str, ...]:
    """Returns the mesh's dim names, or raises naming ``purpose`` if it has none."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"{purpose} needs a mesh with named dims, got an unnamed mesh of shape {mesh.shape}")
    return tuple(names)


def shard_dim_name(mesh: DeviceMesh, *, purpose: str) -> str:
    """Returns the one dim whose name ends in ``"shard"``.

    Raises:
        ValueError: If no dim or more than one dim is named so; the message lists the mesh's dims.
    """
    names = mesh_dim_names(mesh, purpose=purpose)
    shard = [name for name in names if name.endswith("shard")]
    if len(shard) != 1:
        raise ValueError(
            f"{purpose} needs exactly one mesh dim whose name ends in 'shard' (the dim to shard "
            f"over); the mesh has dims {names}"
        )
    return shard[0]


def require_one_dim(mesh: DeviceMesh, *, purpose: str) -> None:
    """Raises if ``mesh`` is not one-dimensional."""
    if mesh.ndim != 1:
        raise ValueError(
            f"{purpose} needs a 1-D mesh, got dims {mesh.mesh_dim_names} of shape {mesh.shape}; "
            "slice the mesh down to the one dim to use"
        )
