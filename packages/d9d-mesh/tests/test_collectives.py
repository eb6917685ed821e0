import torch
import torch.distributed as dist

from d9d.mesh import all_gather_object, all_gather_variable_shape, gather_object, gather_variable_shape
from d9d.mesh.testing import run_distributed


def _variable_shapes() -> None:
    rank = dist.get_rank()
    mine = torch.full((rank + 1, 2), float(rank))
    gathered = all_gather_variable_shape(mine)
    for r, t in enumerate(gathered):
        torch.testing.assert_close(t, torch.full((r + 1, 2), float(r)))
    at_root = gather_variable_shape(mine, dst=0)
    if rank == 0:
        assert at_root is not None
        assert [tuple(t.shape) for t in at_root] == [(r + 1, 2) for r in range(dist.get_world_size())]
    else:
        assert at_root is None
    assert all_gather_object({"rank": rank}) == [{"rank": r} for r in range(dist.get_world_size())]
    objs = gather_object(rank * 10, dst=1)
    assert objs == ([0, 10, 20] if rank == 1 else None)


def test_variable_shape_and_object_gathers() -> None:
    run_distributed(_variable_shapes, world_size=3)
