import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    GradientSynchronizer,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    parallelize_fsdp,
    parallelize_replicate,
    synchronize_replicas,
)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.norm = nn.RMSNorm(4)
        self.proj = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(self.proj(self.norm(self.embed(ids))))


def _meta_flow() -> None:
    # d9d's provider flow: build on meta, parallelize, materialize, initialize.
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Model()
    parallelize_module(
        model,
        mesh["tp"],
        {
            "embed": VocabParallelEmbedding(sequence_parallel=True),
            "norm": SequenceParallelNorm(),
            "proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    parallelize_replicate(model.head, mesh=mesh["dp"])
    parallelize_fsdp(model, mesh=mesh["dp"], ignored_params=model.head.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    synchronize_replicas(model)
    assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters())
    assert model.embed.weight.to_local().shape == (2, 4)  # FSDP(2) of the tp(2) shard of 8 rows
    sync = GradientSynchronizer(model)
    out = model(torch.tensor([[1, 7, 3, 0]]))
    assert (
        out.shape == (1, 4, 3) and torch.isfinite(out.to_local() if isinstance(out, DTensor) else out).all()
    )
    out_local = out.to_local() if isinstance(out, DTensor) else out
    out_local.sum().backward()
    sync.finish()
    assert all(p.grad is not None for p in model.parameters())
    # Replicas are equal after synchronize_replicas: the head over dp, the norm (FSDP-sharded
    # over dp, replicated over tp) over tp.
    for local, group in (
        (model.head.weight.to_local(), mesh.get_group("dp")),
        (model.norm.weight.to_local(), mesh.get_group("tp")),
    ):
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        assert all(torch.equal(g, gathered[0]) for g in gathered)


def test_build_on_meta_parallelize_materialize() -> None:
    run_distributed(_meta_flow, world_size=4, timeout_s=120)
