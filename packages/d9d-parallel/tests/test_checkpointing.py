import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from d9d.mesh.testing import run_distributed
from d9d.parallel import LocalParameterSlot, install_local_forward, parallelize_fsdp, parallelize_replicate


def _round_trip(path: str) -> None:
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(4, 2))
    expected = {name: p.detach().clone() for name, p in model.state_dict().items()}
    parallelize_module(model[0], mesh["tp"], ColwiseParallel())  # TP
    parallelize_fsdp(model[1], mesh=mesh["dp"])  # FSDP
    model[2].weight = nn.Parameter(distribute_tensor(model[2].weight.detach(), mesh, [Shard(1), Shard(0)]))
    install_local_forward(
        model[2],
        [LocalParameterSlot(owner=model[2], name="weight", grad_placements=(Partial(),) * 2, gather=True)],
    )  # a user's 2-D placement
    parallelize_replicate(model, mesh=mesh)  # the rest
    assert all(isinstance(p, DTensor) for p in model.parameters())

    dcp.save(model.state_dict(), checkpoint_id=path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        torch.testing.assert_close(full, expected[name], msg=name)
    dist.barrier()


def test_dcp_round_trips_every_placement(tmp_path) -> None:
    # TP, FSDP, a user's (Shard(1), Shard(0)) weight and replicas in one model, saved and loaded
    run_distributed(_round_trip, str(tmp_path / "checkpoint"), world_size=4, timeout_s=180)
