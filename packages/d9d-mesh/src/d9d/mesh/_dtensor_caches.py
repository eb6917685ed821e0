"""Torch's process-wide DTensor caches, which keep device meshes (and their process groups) alive."""

from __future__ import annotations

import importlib
import sys

# Each entry: a module and the attribute path, from it, of a zero-argument function that empties
# one of torch's DTensor caches whose keys or values hold the DeviceMesh a result was computed for.
_CACHE_CLEARERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # sharding propagation results (the Python cache and the C++ fast path), keyed by the specs
    ("torch.distributed.tensor.debug", ("_clear_sharding_prop_cache",)),
    # redistribute planners: keyed by a weak reference to the mesh, but each holds the mesh
    ("torch.distributed.tensor._redistribute", ("clear_redistribute_planner_cache",)),
    # redistribute steps, keyed by the source and target specs
    ("torch.distributed.tensor._redistribute", ("_gen_transform_infos", "cache_clear")),
    # the collectives' cost model's view of a mesh, keyed by the mesh
    ("torch.distributed.tensor._collective_utils", ("MeshTopoInfo", "build_from_mesh", "cache_clear")),
)


def clear_dtensor_caches() -> None:
    """Empties torch's DTensor caches that hold device meshes.

    A DeviceMesh holds its process groups, and torch destroys a group's backend (gloo's worker
    threads) only when the last reference to the group goes; these caches live as long as the
    process, so without this every group a DTensor ever ran on outlives ``destroy_process_group``.
    Emptying them only costs recomputing entries on the next DTensor operation. A cache a torch
    release renamed or dropped is skipped (the context tests fail if a mesh is still held).
    """
    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor was ever used: nothing is cached
    for module_name, path in _CACHE_CLEARERS:
        try:
            target: object = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        for name in path:
            target = getattr(target, name, None)
        if callable(target):
            target()
