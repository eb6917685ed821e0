import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    ContextParallelAttention,
    context_parallel_position_ids,
    context_parallel_shard,
    context_parallel_unshard,
    parallelize_context_parallel,
    parallelize_replicate,
)

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, SEQ = 8, 4, 2, 4, 16


class ReferenceAttention:
    """Full-sequence attention written independently: an explicit mask over global positions.

    The slot's mask: ``j <= i`` when causal, ``|i - j| < w`` with a window, same document.
    """

    def attend(self, query, key, value, *, causal, softmax_scale, sliding_window=None, document_ids=None):
        seq = query.shape[1]
        i = torch.arange(seq).unsqueeze(1)
        j = torch.arange(seq).unsqueeze(0)
        mask = torch.ones(seq, seq, dtype=torch.bool)
        if causal:
            mask &= j <= i
        if sliding_window is not None:
            mask &= (i - j < sliding_window) & (j - i < sliding_window)
        mask = mask.unsqueeze(0)
        if document_ids is not None:
            mask = mask & (document_ids.unsqueeze(2) == document_ids.unsqueeze(1))
        repeat = query.shape[2] // key.shape[2]
        q = query.transpose(1, 2)
        k = key.repeat_interleave(repeat, 2).transpose(1, 2)
        v = value.repeat_interleave(repeat, 2).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) * softmax_scale
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2)


class TinyAttention(nn.Module):
    """GQA with positions mixed into queries and keys, and a replaceable attention backend."""

    def __init__(self, causal: bool, sliding_window: int | None) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, Q_HEADS * HEAD_DIM)
        self.k = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(Q_HEADS * HEAD_DIM, HIDDEN)
        self.causal = causal
        self.sliding_window = sliding_window
        self.attention_backend = ReferenceAttention()

    def forward(self, x, position_ids, document_ids):
        b, s, _ = x.shape
        angle = position_ids.unsqueeze(-1).unsqueeze(-1).float() * 0.3
        q = self.q(x).view(b, s, Q_HEADS, HEAD_DIM) * torch.cos(angle)
        k = self.k(x).view(b, s, KV_HEADS, HEAD_DIM) * torch.cos(angle)
        v = self.v(x).view(b, s, KV_HEADS, HEAD_DIM)
        out = self.attention_backend.attend(
            q,
            k,
            v,
            causal=self.causal,
            softmax_scale=HEAD_DIM**-0.5,
            sliding_window=self.sliding_window,
            document_ids=document_ids,
        )
        return self.o(out.reshape(b, s, -1))


def _batch(generator, with_documents: bool):
    x = torch.randn(2, SEQ, HIDDEN, generator=generator)
    target = torch.randn(2, SEQ, HIDDEN, generator=generator)
    positions = torch.arange(SEQ).expand(2, SEQ)
    # Packed sequences: row 0 holds documents of 5 and 11 tokens, row 1 one document.
    documents = torch.zeros(2, SEQ, dtype=torch.long)
    if with_documents:
        documents[0, 5:] = 1
    return x, target, positions, documents


def _loss(model, batch):
    x, target, positions, documents = batch
    return nn.functional.mse_loss(model(x, positions, documents), target)


def _context_parallel(harness, causal, sliding_window, with_documents) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("cp",))

    def parallelize(model):
        parallelize_replicate(model, mesh=mesh)  # parameters: replicas over the cp ranks
        parallelize_context_parallel(model, mesh=mesh)
        assert isinstance(model.attention_backend, ContextParallelAttention)

    def shard(batch):
        x, target, _, documents = batch
        local = [context_parallel_shard(t, mesh=mesh) for t in (x, target, documents)]
        positions = context_parallel_position_ids(2, SEQ, mesh=mesh)
        torch.testing.assert_close(positions, context_parallel_shard(batch[2], mesh=mesh))
        return local[0], local[1], positions, local[2]

    harness.ReferenceCheck(
        build=lambda: TinyAttention(causal, sliding_window),
        parallelize=parallelize,
        make_batch=lambda g: _batch(g, with_documents),
        loss_fn=_loss,
        shard_batch=shard,
        # the cp rows of one batch row are not split into microbatches (dim 0 is the batch)
        microbatches=2,
        max_norm=0.05,
    ).run()


@pytest.mark.parametrize(
    ("world", "causal", "sliding_window", "with_documents"),
    [
        (2, True, None, False),  # causal, cp=2 (4 chunks of 4 tokens)
        (4, True, None, False),  # causal, cp=4 (8 chunks of 2 tokens)
        (2, True, 6, True),  # causal with a sliding window and packed documents, cp=2
        (2, False, 6, True),  # two-sided sliding window (not causal) and packed documents, cp=2
        (2, False, None, False),  # bidirectional without a mask, cp=2
    ],
)
def test_context_parallel_attention_matches_full_sequence(
    harness, world, causal, sliding_window, with_documents
) -> None:
    run_distributed(
        _context_parallel, harness, causal, sliding_window, with_documents, world_size=world, timeout_s=180
    )


def _sharding_round_trip_and_errors() -> None:
    mesh = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("cp",))
    full = torch.arange(3 * 8).view(3, 8).float()
    local = context_parallel_shard(full, mesh=mesh)
    rank = mesh.get_local_rank()
    # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (of 2 tokens each)
    expected_positions = [[0, 1, 6, 7], [2, 3, 4, 5]][rank]
    torch.testing.assert_close(local, full[:, expected_positions])
    torch.testing.assert_close(context_parallel_unshard(local, mesh=mesh), full)
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2 \* cp = 4"):
        context_parallel_shard(torch.zeros(1, 6), mesh=mesh)
    q = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match="local sequence length 3 is odd"):
        ContextParallelAttention(mesh=mesh).attend(q, q, q, causal=True, softmax_scale=1.0)
    with pytest.raises(ValueError, match="sliding_window=0 must be positive"):
        ContextParallelAttention(mesh=mesh).attend(q, q, q, causal=True, softmax_scale=1.0, sliding_window=0)


def test_sharding_helpers_round_trip_and_bad_lengths_are_named() -> None:
    run_distributed(_sharding_round_trip_and_errors, world_size=2, timeout_s=120)
