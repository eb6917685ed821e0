import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    SequenceParallelNorm,
    VocabParallelEmbedding,
    parallelize_fsdp,
    vocab_parallel_cross_entropy,
)

VOCAB, HIDDEN, SEQ = 12, 8, 4


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.RMSNorm(HIDDEN, elementwise_affine=True)
        self.up = nn.Linear(HIDDEN, 16)
        self.down = nn.Linear(16, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        return self.head(h)


def _batch(generator: torch.Generator):
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
    labels[0, 0] = -100  # an ignored token
    return ids, labels


def _reference_loss(model, batch):
    ids, labels = batch
    # Sum over tokens / token count: averaging over ranks and microbatches gives the same value
    # even with an ignored token in one of them.
    return (
        nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="sum") / ids.numel()
    )


def _tensor_parallel(harness, dp: int) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(dp, world // dp), mesh_dim_names=("dp", "tp"))
    tp_mesh = mesh["tp"]

    def parallelize(model: nn.Module) -> None:
        # TP first, then FSDP on top: fully_shard adds the dp dim to the tp placements.
        parallelize_module(
            model,
            tp_mesh,
            {
                "embed": VocabParallelEmbedding(sequence_parallel=True),
                "norm": SequenceParallelNorm(),
                "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1)),
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),
            },
        )
        assert model.embed.weight.placements == (Shard(0),)
        assert model.norm.weight.placements == (Replicate(),)
        if dp > 1:
            parallelize_fsdp(model, mesh=mesh["dp"])
            # (dp, tp): FSDP's dim-0 shards of the tp shards (torch marks them _StridedShard)
            dp_placement, tp_placement = model.up.weight.placements
            assert dp_placement.is_shard(0) or "StridedShard" in repr(dp_placement)
            assert tp_placement == Shard(0)
            dp_placement, tp_placement = model.norm.weight.placements
            assert dp_placement == Shard(0) and tp_placement == Replicate()

    def parallel_loss(model, batch):
        ids, labels = batch
        logits = model(ids)
        assert not isinstance(logits, DTensor) and logits.shape[-1] == VOCAB // tp_mesh.size()
        loss = vocab_parallel_cross_entropy(
            logits.flatten(0, 1), labels.flatten(), mesh=tp_mesh, reduction="sum"
        )
        return loss / ids.numel()

    dp_rank = mesh.get_local_rank("dp")
    harness.ReferenceCheck(
        build=TinyLM,
        parallelize=parallelize,
        make_batch=_batch,
        loss_fn=_reference_loss,
        parallel_loss_fn=parallel_loss,
        shard_batch=lambda batch: tuple(t.chunk(dp)[dp_rank] for t in batch),
        microbatches=2 if dp > 1 else 1,
        max_norm=0.5,
    ).run()


@pytest.mark.parametrize(
    ("world", "dp"),
    [
        (2, 1),  # TP over 2 ranks with sequence parallelism and a vocab-parallel embedding and loss
        (4, 2),  # FSDP (2) x TP (2) on a 2-D mesh, gradient accumulation over 2 microbatches
    ],
)
def test_tensor_parallel_matches_single_process(harness, world, dp) -> None:
    run_distributed(_tensor_parallel, harness, dp, world_size=world, timeout_s=180)


def _cross_entropy() -> None:
    mesh = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("tp",))
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 6, generator=generator, dtype=torch.float64).float()
    labels = torch.tensor([0, 5, 3, -100, 2])
    local = logits.chunk(2, dim=-1)[mesh.get_local_rank()].clone().requires_grad_(True)
    full = logits.clone().requires_grad_(True)
    for reduction in ("mean", "sum", "none"):
        expected = nn.functional.cross_entropy(full, labels, reduction=reduction)
        actual = vocab_parallel_cross_entropy(local, labels, mesh=mesh, reduction=reduction)
        torch.testing.assert_close(actual, expected)
        weights = torch.arange(1.0, 6.0) if reduction == "none" else torch.ones(())
        (actual * weights).sum().backward()
        (expected * weights).sum().backward()
        torch.testing.assert_close(local.grad, full.grad.chunk(2, dim=-1)[mesh.get_local_rank()])
        local.grad = None
        full.grad = None
    with pytest.raises(ValueError, match="differ outside the vocabulary dim"):
        vocab_parallel_cross_entropy(local, labels[:3], mesh=mesh)
    with pytest.raises(ValueError, match="vocabulary size 5 is not divisible by the tp degree 2"):
        parallelize_module(nn.Embedding(5, 2), mesh, VocabParallelEmbedding())


def test_vocab_parallel_cross_entropy_matches_torch() -> None:
    run_distributed(_cross_entropy, world_size=2, timeout_s=120)
