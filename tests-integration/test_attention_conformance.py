"""Conformance: d9d-kernels' real ``GroupedQueryAttention`` under d9d-parallel's context parallelism.

The attention slot's mask is defined once, by d9d-kernels' ``AttentionBackend``; d9d-parallel's
``ContextParallelAttention`` restates only the signature. Each case runs the layer with the eager
backend over the full sequence in one process (the reference) and a copy of it with
``ContextParallelAttention`` installed in its slot over each cp rank's load-balanced part:
outputs, input gradients and parameter gradients must agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from d9d.kernels.layers import (
    EagerAttentionBackend,
    GroupedQueryAttention,
    RotaryEmbedding,
    position_ids_from_document_ids,
)
from d9d.mesh.testing import run_distributed
from d9d.parallel import ContextParallelAttention, context_parallel_shard, parallelize_context_parallel

BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2, 16, 16, 4, 2, 8
# Row 0 packs documents of 5, 7 and 4 tokens, row 1 of 9 and 7: boundaries fall inside cp chunks.
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}

# (causal, sliding_window, packed documents); a window of 5 spans several cp chunks of 2 or 4 tokens
MASK_CASES = [
    (True, None, False),  # causal
    (True, 5, False),  # causal sliding window: i - 5 < j <= i
    (False, 5, False),  # non-causal sliding window: |i - j| < 5, both sides
    (False, None, False),  # non-causal, full
    (True, None, True),  # causal within packed documents
    (False, None, True),  # non-causal within packed documents
    (True, 5, True),  # causal sliding window within packed documents
    (False, 5, True),  # non-causal sliding window within packed documents
]


def _forward_backward(
    attention: GroupedQueryAttention,
    rotary: RotaryEmbedding,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    documents: torch.Tensor | None,
    upstream: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the output and the input gradient of ``sum(output * upstream)``."""
    hidden = hidden.detach().requires_grad_(True)
    output = attention(hidden, rotary(positions), document_ids=documents)
    (output * upstream).sum().backward()
    assert hidden.grad is not None
    return output.detach(), hidden.grad


def _conformance(causal: bool, sliding_window: int | None, packed: bool) -> None:
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    reference = GroupedQueryAttention(
        HIDDEN,
        HEADS,
        KV_HEADS,
        head_dim=HEAD_DIM,
        qk_norm=True,
        bias=True,
        causal=causal,
        sliding_window=sliding_window,
        attention_backend=EagerAttentionBackend(),
    )
    with torch.no_grad():  # non-trivial biases and norm scales, so their gradients are checked too
        for parameter in reference.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    model = copy.deepcopy(reference)
    parallelize_context_parallel(model, mesh=mesh)
    assert isinstance(model.attention_backend, ContextParallelAttention)
    rotary = RotaryEmbedding(HEAD_DIM)

    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    upstream = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    documents = DOCUMENTS if packed else None
    positions = position_ids_from_document_ids(DOCUMENTS) if packed else torch.arange(SEQ).expand(BATCH, SEQ)

    expected, expected_grad = _forward_backward(reference, rotary, hidden, positions, documents, upstream)

    def shard(tensor: torch.Tensor) -> torch.Tensor:
        return context_parallel_shard(tensor, mesh=mesh)

    output, grad = _forward_backward(
        model,
        rotary,
        shard(hidden),
        shard(positions),
        None if documents is None else shard(documents),
        shard(upstream),
    )
    torch.testing.assert_close(output, shard(expected), **TOLERANCE, msg=lambda m: f"output: {m}")
    torch.testing.assert_close(grad, shard(expected_grad), **TOLERANCE, msg=lambda m: f"input grad: {m}")
    # Parameters are replicas: each rank's gradient covers its own tokens, their sum all tokens.
    for (name, parameter), ref_parameter in zip(
        model.named_parameters(), reference.parameters(), strict=True
    ):
        assert parameter.grad is not None and ref_parameter.grad is not None, name
        dist.all_reduce(parameter.grad)
        torch.testing.assert_close(
            parameter.grad, ref_parameter.grad, **TOLERANCE, msg=lambda m, n=name: f"grad {n}: {m}"
        )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("causal", "sliding_window", "packed"), MASK_CASES)
def test_grouped_query_attention_under_context_parallelism_matches_eager(
    world: int, causal: bool, sliding_window: int | None, packed: bool
) -> None:
    run_distributed(_conformance, causal, sliding_window, packed, world_size=world, timeout_s=120)
