"""d9d-parallel's strategies on two ranks against one process (models as in packages/d9d-parallel/tests)."""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
from mg_case_env import Case, CaseEnv
from mg_harness import Batch, ReferenceCheck, full, rows_of_rank
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from d9d.mesh import DENSE_DOMAIN, DistributedContext, MeshParameters
from d9d.parallel import (
    AllToAllTokenDispatcher,
    ContextParallelAttention,
    GradientSynchronizer,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    clip_grad_norm,
    context_parallel_position_ids,
    context_parallel_shard,
    context_parallel_unshard,
    parallelize_context_parallel,
    parallelize_expert_parallel,
    parallelize_fsdp,
    parallelize_hsdp,
    parallelize_replicate,
    vocab_parallel_cross_entropy,
)


def _mlp(sizes: tuple[int, ...] = (8, 16, 6)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for index, (a, b) in enumerate(itertools.pairwise(sizes)):
        if index:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def _regression(generator: torch.Generator) -> Batch:
    return torch.randn(8, 8, generator=generator), torch.randn(8, 6, generator=generator)


def _mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _fsdp(env: CaseEnv) -> str:
    mesh = env.mesh((dist.get_world_size(),), ("dp_shard",))

    def parallelize(model: nn.Module) -> None:
        for layer in model:
            if isinstance(layer, nn.Linear):
                parallelize_fsdp(layer, mesh=mesh)
        parallelize_fsdp(model, mesh=mesh)

    ReferenceCheck(
        device=env.device,
        build=_mlp,
        parallelize=parallelize,
        make_batch=_regression,
        loss_fn=_mse,
        tolerance=env.tolerance,
        shard_batch=rows_of_rank,
        microbatches=2,
    ).run()
    return "dp_shard=2, 2 microbatches, 3 AdamW steps"


def _hsdp(env: CaseEnv) -> str:
    # Two GPUs allow 2 replicas x 1 shard: the replicate dim all-reduces, the shard dim is trivial.
    parameters = MeshParameters(data_parallel_replicate=2, data_parallel_shard=1)
    context = DistributedContext(parameters, device_type="cuda" if env.is_cuda else "cpu")
    mesh = context.mesh_for(DENSE_DOMAIN)["dp_replicate", "dp_cp_shard", "cp_replicate"]

    def parallelize(model: nn.Module) -> None:
        parallelize_hsdp(model, mesh=mesh)
        for p in model.parameters():
            if not isinstance(p, DTensor) or p.placements != (Replicate(), Shard(0)):
                raise AssertionError(f"unexpected HSDP placement {getattr(p, 'placements', None)}")

    ReferenceCheck(
        device=env.device,
        build=_mlp,
        parallelize=parallelize,
        make_batch=_regression,
        loss_fn=_mse,
        tolerance=env.tolerance,
        shard_batch=rows_of_rank,
        microbatches=2,
    ).run()
    context.close()
    return "dp_replicate=2 x dp_shard=1 (the 2-D call a 2x2 job makes)"


VOCAB, HIDDEN, SEQ = 12, 8, 4


class _TinyLM(nn.Module):
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


def _lm_batch(generator: torch.Generator) -> Batch:
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
    labels[0, 0] = -100
    return ids, labels


def _lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, labels = batch
    logits = model(ids).flatten(0, 1)
    return nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum") / ids.numel()


def _tensor_parallel(env: CaseEnv) -> str:
    tp_mesh = env.mesh((dist.get_world_size(),), ("tp",))

    def parallelize(model: nn.Module) -> None:
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

    def parallel_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        ids, labels = batch
        logits = model(ids)
        loss = vocab_parallel_cross_entropy(
            logits.flatten(0, 1), labels.flatten(), mesh=tp_mesh, reduction="sum"
        )
        return loss / ids.numel()

    ReferenceCheck(
        device=env.device,
        build=_TinyLM,
        parallelize=parallelize,
        make_batch=_lm_batch,
        loss_fn=_lm_loss,
        parallel_loss_fn=parallel_loss,
        tolerance=env.tolerance,
        max_norm=0.5,
    ).run()
    return "tp=2, sequence-parallel norm, vocab-parallel embedding and loss"


Q_HEADS, KV_HEADS, HEAD_DIM, CP_SEQ = 4, 2, 4, 16
CP_LONG_SEQ = 32768


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    sliding_window: int | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-sequence attention with an explicit mask over global positions (fp32 maths)."""
    seq = query.shape[1]
    i = torch.arange(seq, device=query.device).unsqueeze(1)
    j = torch.arange(seq, device=query.device).unsqueeze(0)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=query.device)
    if causal or sliding_window is not None:
        mask &= j <= i
    if sliding_window is not None:
        mask &= i - j < sliding_window
    mask = mask.unsqueeze(0)
    if document_ids is not None:
        mask = mask & (document_ids.unsqueeze(2) == document_ids.unsqueeze(1))
    repeat = query.shape[2] // key.shape[2]
    q = query.transpose(1, 2).float()
    k = key.repeat_interleave(repeat, 2).transpose(1, 2).float()
    v = value.repeat_interleave(repeat, 2).transpose(1, 2).float()
    scores = (q @ k.transpose(-1, -2)) * softmax_scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).to(query.dtype)


class _ReferenceBackend:
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float,
        sliding_window: int | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return reference_attention(
            query,
            key,
            value,
            causal=causal,
            softmax_scale=softmax_scale,
            sliding_window=sliding_window,
            document_ids=document_ids,
        )


class _TinyAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, Q_HEADS * HEAD_DIM)
        self.k = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.v = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.o = nn.Linear(Q_HEADS * HEAD_DIM, HIDDEN)
        self.attention_backend: ContextParallelAttention | _ReferenceBackend = _ReferenceBackend()

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor
    ) -> torch.Tensor:
        b, s, _ = x.shape
        angle = position_ids.unsqueeze(-1).unsqueeze(-1).float() * 0.3
        q = self.q(x).view(b, s, Q_HEADS, HEAD_DIM) * torch.cos(angle)
        k = self.k(x).view(b, s, KV_HEADS, HEAD_DIM) * torch.cos(angle)
        v = self.v(x).view(b, s, KV_HEADS, HEAD_DIM)
        out = self.attention_backend.attend(
            q, k, v, causal=True, softmax_scale=HEAD_DIM**-0.5, document_ids=document_ids
        )
        return self.o(out.reshape(b, s, -1))


def _cp_batch(generator: torch.Generator) -> Batch:
    x = torch.randn(2, CP_SEQ, HIDDEN, generator=generator)
    target = torch.randn(2, CP_SEQ, HIDDEN, generator=generator)
    positions = torch.arange(CP_SEQ).expand(2, CP_SEQ)
    documents = torch.zeros(2, CP_SEQ, dtype=torch.long)
    documents[0, 5:] = 1  # packed: documents of 5 and 11 tokens in row 0
    return x, target, positions, documents


def _cp_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, target, positions, documents = batch
    return nn.functional.mse_loss(model(x, positions, documents), target)


def _context_parallel(env: CaseEnv) -> str:
    mesh = env.mesh((dist.get_world_size(),), ("cp",))

    def parallelize(model: nn.Module) -> None:
        parallelize_replicate(model, mesh=mesh)
        parallelize_context_parallel(model, mesh=mesh)  # pyright: ignore[reportArgumentType]

    def shard(batch: Batch) -> Batch:
        x, target, _, documents = batch
        local = [context_parallel_shard(t, mesh=mesh) for t in (x, target, documents)]
        positions = context_parallel_position_ids(2, CP_SEQ, mesh=mesh).to(env.device)
        return local[0], local[1], positions, local[2]

    ReferenceCheck(
        device=env.device,
        build=_TinyAttention,
        parallelize=parallelize,
        make_batch=_cp_batch,
        loss_fn=_cp_loss,
        tolerance=env.tolerance,
        shard_batch=shard,
        microbatches=2,
    ).run()
    return "cp=2 load-balanced causal attention with packed documents, replicated weights"


def _context_parallel_32k(env: CaseEnv) -> str:
    """The attention op alone at sequence 32768, against fp32 SDPA over the whole sequence."""
    mesh = env.mesh((dist.get_world_size(),), ("cp",))
    seq, heads, kv_heads, dim = CP_LONG_SEQ, 4, 2, 64
    generator = torch.Generator(device=env.device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=env.device, generator=generator)

    q, k, v = rand(1, seq, heads, dim), rand(1, seq, kv_heads, dim), rand(1, seq, kv_heads, dim)
    grad_out = rand(1, seq, heads, dim)
    scale = dim**-0.5
    full_inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    # Keys and values repeated per query head, so fp32 SDPA can use its memory-efficient kernel.
    fq = full_inputs[0].transpose(1, 2)
    fk, fv = (t.repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2) for t in full_inputs[1:])
    expected = nn.functional.scaled_dot_product_attention(fq, fk, fv, is_causal=True, scale=scale).transpose(
        1, 2
    )
    expected.backward(grad_out)

    local = [context_parallel_shard(t, mesh=mesh).requires_grad_(True) for t in (q, k, v)]
    out = ContextParallelAttention(mesh=mesh).attend(*local, causal=True, softmax_scale=scale)
    out.backward(context_parallel_shard(grad_out, mesh=mesh))
    env.tolerance.check(context_parallel_unshard(out.detach(), mesh=mesh), expected, "output")
    for name, mine, ref in zip("qkv", local, full_inputs, strict=True):
        assert mine.grad is not None and ref.grad is not None
        env.tolerance.check(context_parallel_unshard(mine.grad, mesh=mesh), ref.grad, f"grad {name}")
    return f"seq={seq}, GQA {heads}/{kv_heads} heads x {dim}, fp32, output and q/k/v grads"


EP_HIDDEN, FFN, EXPERTS, TOP_K = 6, 5, 4, 2


class _Experts(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, EP_HIDDEN, FFN) * 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, FFN, EP_HIDDEN) * 0.5)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        groups = tokens.split(tokens_per_expert.tolist())
        outs = [torch.tanh(g @ self.w_in[e]) @ self.w_out[e] for e, g in enumerate(groups)]
        return torch.cat(outs) if outs else tokens


class _LocalDispatcher:
    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.order = torch.empty(0, dtype=torch.long)
        self.weights = torch.empty(0)

    def dispatch(
        self, hidden: torch.Tensor, expert_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat = expert_indices.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.weights = routing_weights
        return hidden[self.order // expert_indices.shape[1]], torch.bincount(flat, minlength=self.num_experts)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        rows = expert_output[torch.argsort(self.order)]
        return (rows.view(*self.weights.shape, -1) * self.weights.unsqueeze(-1)).sum(1)


class _TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.top_k = TOP_K
        self.router = nn.Linear(EP_HIDDEN, EXPERTS, bias=False)
        self.shared_expert = nn.Linear(EP_HIDDEN, EP_HIDDEN)
        self.experts = _Experts(EXPERTS)
        self.dispatcher: _LocalDispatcher | AllToAllTokenDispatcher = _LocalDispatcher(EXPERTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        tokens, counts = self.dispatcher.dispatch(x, indices, weights)
        return self.dispatcher.combine(self.experts(tokens, counts)) + self.shared_expert(x)


def _ep_batch(generator: torch.Generator) -> Batch:
    return torch.randn(16, EP_HIDDEN, generator=generator), torch.randn(16, EP_HIDDEN, generator=generator)


def _expert_parallel(env: CaseEnv) -> str:
    mesh = env.mesh((dist.get_world_size(),), ("ep",))

    def parallelize(model: nn.Module) -> None:
        parallelize_expert_parallel(model, mesh=mesh)  # pyright: ignore[reportArgumentType]
        if not isinstance(model.dispatcher, AllToAllTokenDispatcher):
            raise AssertionError("the all-to-all dispatcher was not installed")

    ReferenceCheck(
        device=env.device,
        build=_TinyMoE,
        parallelize=parallelize,
        make_batch=_ep_batch,
        loss_fn=_mse,
        tolerance=env.tolerance,
        shard_batch=rows_of_rank,
        microbatches=2,
        max_norm=0.3,
    ).run()
    return "ep=2 (2 experts per rank), top-2 routing, all-to-all dispatcher"


def _deep_mlp() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])


def _bucketed_sync(env: CaseEnv) -> str:
    """Buckets go out during backward (before its last gradient) and equal a plain all-reduce."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = env.mesh((world,), ("dp",))
    torch.manual_seed(0)
    plain = _deep_mlp().to(env.device)
    model = _deep_mlp().to(env.device)
    model.load_state_dict(plain.state_dict())
    parallelize_replicate(model, mesh=mesh)
    sync = GradientSynchronizer(model, bucket_size_mb=1e-6)  # every gradient fills a bucket
    params = list(model.parameters())
    launched_at_grad: list[int] = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _p: launched_at_grad.append(sync.launched_buckets))
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank)).to(env.device)
    sync.begin_microbatch(is_last=True)
    model(x).square().mean().backward()
    early = launched_at_grad[0]
    in_flight = sync.in_flight_buckets
    sync.finish()
    sync.close()
    if early < 1:
        raise AssertionError(f"no bucket launched at the first gradient: {launched_at_grad}")
    plain(x).square().mean().backward()
    for (name, expected), p in zip(plain.named_parameters(), params, strict=True):
        assert expected.grad is not None and p.grad is not None
        reduced = expected.grad.clone()
        dist.all_reduce(reduced)
        env.tolerance.check(full(p.grad), reduced / world, name)
    return f"{len(params)} buckets; {early} launched at the first gradient, {in_flight} in flight at end"


def _distributed_clipping(env: CaseEnv) -> str:
    """Norm over FSDP shards, TP shards and replicas at once equals the single-process norm."""
    world = dist.get_world_size()
    mesh = env.mesh((world,), ("dp",))
    torch.manual_seed(3)
    reference = _mlp((8, 16, 16, 6)).to(env.device)
    model = _mlp((8, 16, 16, 6)).to(env.device)
    model.load_state_dict(reference.state_dict())
    parallelize_fsdp(model[0], mesh=mesh)
    parallelize_module(model[2], mesh, ColwiseParallel(output_layouts=Replicate()))
    parallelize_replicate(model, mesh=mesh)
    x, y = (t.to(env.device) for t in _regression(torch.Generator().manual_seed(9)))
    xs = x.chunk(world)
    reference_loss = sum(_mse(reference, (xs[r], y.chunk(world)[r])) for r in range(world)) / world
    assert isinstance(reference_loss, torch.Tensor)
    reference_loss.backward()
    sync = GradientSynchronizer(model)
    # TP ranks see the same input rows; FSDP/replicated gradients are averaged, so feed the
    # mean loss of both shards on each rank (identical inputs keep TP exact).
    loss = sum(_mse(model, (xs[r], y.chunk(world)[r])) for r in range(world)) / world
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    sync.finish()
    sync.close()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    norm = clip_grad_norm(list(model.parameters()), 0.01)
    env.tolerance.check(norm, expected, "total norm")
    for (name, ref), p in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert ref.grad is not None and p.grad is not None
        env.tolerance.check(full(p.grad), ref.grad, f"clipped grad {name}")
    if not math.isfinite(float(norm)) or float(norm) <= 0.01:
        raise AssertionError(f"norm {float(norm)} does not exercise clipping")
    return f"FSDP + TP + replicated params, norm {float(norm):.4g} clipped to 0.01"


CASES = [
    Case(name="fsdp", run=_fsdp),
    Case(name="hsdp", run=_hsdp),
    Case(name="tp_sequence_parallel", run=_tensor_parallel),
    Case(name="cp", run=_context_parallel),
    Case(name="cp_attention_32k", run=_context_parallel_32k, cuda_only=True),
    Case(name="ep_all_to_all", run=_expert_parallel),
    Case(name="bucketed_sync_overlap", run=_bucketed_sync),
    Case(name="distributed_clipping", run=_distributed_clipping),
]
