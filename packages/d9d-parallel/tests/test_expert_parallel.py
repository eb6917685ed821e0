import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from d9d.mesh.testing import run_distributed
from d9d.parallel import AllToAllTokenDispatcher, all_to_all, parallelize_expert_parallel

HIDDEN, FFN, EXPERTS, TOP_K = 6, 5, 4, 2


class TinyExperts(nn.Module):
    """Expert MLPs with weights (E, H, F) and (E, F, H), over tokens grouped by expert."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, HIDDEN, FFN) * 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, FFN, HIDDEN) * 0.5)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        groups = tokens.split(tokens_per_expert.tolist())
        outs = [torch.tanh(g @ self.w_in[e]) @ self.w_out[e] for e, g in enumerate(groups)]
        return torch.cat(outs) if outs else tokens


class LocalDispatcher:
    """The single-process dispatcher of the reference model."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, hidden, expert_indices, routing_weights):
        flat = expert_indices.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.weights = routing_weights
        return hidden[self.order // expert_indices.shape[1]], torch.bincount(flat, minlength=self.num_experts)

    def combine(self, expert_output):
        rows = expert_output[torch.argsort(self.order)]
        return (rows.view(*self.weights.shape, -1) * self.weights.unsqueeze(-1)).sum(1)


class TinyMoE(nn.Module):
    """Fits the MoE slot: router, shared expert, experts and a replaceable dispatcher."""

    def __init__(self, num_experts: int = EXPERTS) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = TOP_K
        self.router = nn.Linear(HIDDEN, num_experts, bias=False)
        self.shared_expert = nn.Linear(HIDDEN, HIDDEN)
        self.experts = TinyExperts(num_experts)
        self.dispatcher = LocalDispatcher(num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        tokens, counts = self.dispatcher.dispatch(x, indices, weights)
        return self.dispatcher.combine(self.experts(tokens, counts)) + self.shared_expert(x)


def _batch(generator: torch.Generator):
    return torch.randn(16, HIDDEN, generator=generator), torch.randn(16, HIDDEN, generator=generator)


def _expert_parallel(harness, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape), mesh_dim_names=names)
    ep = mesh.size(len(names) - 1)
    received: list[int] = []

    def parallelize(model: nn.Module) -> None:
        parallelize_expert_parallel(model, mesh=mesh)
        assert isinstance(model.dispatcher, AllToAllTokenDispatcher)
        expected = (Replicate(),) * (len(names) - 1) + (Shard(0),)
        assert model.experts.w_in.placements == expected
        assert model.experts.w_in.to_local().shape[0] == EXPERTS // ep
        assert model.router.weight.placements == (Replicate(),) * len(names)
        model.experts.register_forward_pre_hook(lambda _m, args: received.append(int(args[1].sum())))

    harness.ReferenceCheck(
        build=TinyMoE,
        parallelize=parallelize,
        make_batch=_batch,
        loss_fn=harness.mse,
        shard_batch=lambda batch: tuple(t.chunk(world)[dist.get_rank()] for t in batch),
        microbatches=2,
        max_norm=0.3,
    ).run()
    # Routing is uneven: ranks' experts received different numbers of rows.
    everyone = [None] * world
    dist.all_gather_object(everyone, received)
    assert len({tuple(r) for r in everyone}) > 1


@pytest.mark.parametrize(
    ("mesh_shape", "names"),
    [
        ((2,), ("ep",)),  # 2 experts per rank
        ((4,), ("ep",)),  # 1 expert per rank
        ((2, 2), ("ep_replicate", "ep_shard")),  # experts sharded over 2, replicated over 2
    ],
)
def test_expert_parallel_matches_single_process(harness, mesh_shape, names) -> None:
    world = 1
    for size in mesh_shape:
        world *= size
    run_distributed(_expert_parallel, harness, mesh_shape, names, world_size=world, timeout_s=180)


def _uneven_all_to_all() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    # Rank r sends r + d rows to rank d (0 rows from rank 0 to rank 0).
    send = [rank + d for d in range(world)]
    receive = [s + rank for s in range(world)]
    x = torch.arange(sum(send), dtype=torch.float32).unsqueeze(1).add(100 * rank).requires_grad_(True)
    out = all_to_all(x, output_splits=receive, input_splits=send, group=group)
    assert out.shape[0] == sum(receive)
    (out * (rank + 1)).sum().backward()
    # Each row went to rank d, whose loss weight is d + 1.
    expected = torch.cat([torch.full((n, 1), float(d + 1)) for d, n in enumerate(send)])
    torch.testing.assert_close(x.grad, expected)


def test_all_to_all_uneven_splits_and_backward() -> None:
    run_distributed(_uneven_all_to_all, world_size=3, timeout_s=120)


def _bad_expert_count() -> None:
    mesh = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("ep",))
    with pytest.raises(
        ValueError, match=r"TinyMoE: num_experts=6 is not divisible by the expert-parallel degree 4"
    ):
        parallelize_expert_parallel(TinyMoE(num_experts=6), mesh=mesh)
    flat = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match=r"ends in 'shard'.*\('a', 'b'\)"):
        parallelize_expert_parallel(TinyMoE(), mesh=flat)


def test_bad_expert_parallel_input_is_named() -> None:
    run_distributed(_bad_expert_count, world_size=4, timeout_s=120)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.moe = TinyMoE()
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(torch.tanh(self.inp(x))))


def _experts_inside_fsdp(harness) -> None:
    from d9d.parallel import parallelize_fsdp

    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp_shard",))

    def parallelize(model: nn.Module) -> None:
        parallelize_expert_parallel(model.moe, mesh=mesh)
        # FSDP shards the dense layers; the MoE's parameters are placed already and left to
        # the synchronizer.
        parallelize_fsdp(model, mesh=mesh, ignored_params=model.moe.parameters())
        assert model.inp.weight.placements == (Shard(0),)
        assert model.moe.experts.w_in.placements == (Shard(0),)
        assert model.moe.router.weight.placements == (Replicate(),)

    harness.ReferenceCheck(
        build=MoEBlock,
        parallelize=parallelize,
        make_batch=_batch,
        loss_fn=harness.mse,
        shard_batch=lambda batch: tuple(t.chunk(world)[dist.get_rank()] for t in batch),
        microbatches=2,
        max_norm=0.1,
    ).run()


def test_expert_parallel_inside_an_fsdp_block_matches_single_process(harness) -> None:
    # EP (2) for the MoE and FSDP (2) for the dense layers of one block, on the same ranks
    run_distributed(_experts_inside_fsdp, harness, world_size=2, timeout_s=180)
