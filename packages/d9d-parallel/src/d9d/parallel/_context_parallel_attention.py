"""Context-parallel attention: exact attention over a sequence split across cp ranks."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import CausalBias, CausalVariant

from d9d.parallel._block_attention import (
    BlockAttentionKernel,
    attend_chunk_causally,
    block_attention_kernel_for,
    expand_heads,
)
from d9d.parallel._load_balanced_positions import local_positions
from d9d.parallel._mesh_dims import require_one_dim
from d9d.parallel._sequence_all_gather import gather_sequence


class AttentionBackend(Protocol):
    """The attention slot of an attention layer (its ``attention_backend``), as d9d-parallel sees it.

    query (batch, seq, q_heads, head_dim); key and value (batch, seq, kv_heads, head_dim) with
    ``q_heads % kv_heads == 0``; returns (batch, seq, q_heads, head_dim). ``causal``,
    ``sliding_window`` and ``document_ids`` mean exactly what d9d-kernels' ``AttentionBackend``
    defines (docs/kernels-layers.md, "Attention masks"); in short, query ``i`` sees key ``j`` iff
    ``j <= i`` when causal, ``|i - j| < sliding_window``, and both are of the same document.
    """

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
    ) -> torch.Tensor: ...


class AttentionLayerLike(Protocol):
    """An attention layer with a replaceable ``attention_backend`` (d9d-kernels' GQA fits).

    The slot is a settable property rather than an attribute: a mutable attribute member would be
    invariant, and a layer that declares its slot with its own (structurally equal) Protocol
    would not fit.
    """

    @property
    def attention_backend(self) -> AttentionBackend:
        """The backend the layer calls; ``parallelize_context_parallel`` replaces it."""
        ...

    @attention_backend.setter
    def attention_backend(self, backend: AttentionBackend) -> None: ...


class ContextParallelAttention:
    """Attention over this rank's load-balanced sequence part that equals full-sequence attention.

    Keys and values (one all-gather for both) and document ids of all cp ranks are gathered and
    put back in sequence order; each local query then attends to exactly the keys it would see
    in the full sequence: the mask of d9d-kernels' ``AttentionBackend`` (causal, causal or
    two-sided sliding window, packed documents) over global positions. The all-gather is
    differentiable (its backward reduce-scatters key and value gradients), so forward and
    backward are exact. Inputs are the local parts from ``context_parallel_shard``.

    Plain causal attention (no window, no documents), the usual pre-training case, runs without a
    mask tensor: each of the rank's two chunks attends causally to its own keys and fully to every
    earlier key, two blocks that run on the fast fused kernels (cuDNN on CUDA) and are merged by
    their log-sum-exp (see ``BlockAttentionKernel``). Where no block kernel exists for the device,
    each chunk runs SDPA with a lower-right causal bias (FlashAttention-2 on CUDA). A dense mask
    would force the slower masked kernels and a local x global boolean tensor per layer.
    Bidirectional attention without window or documents needs no mask at all.
    """

    def __init__(self, *, mesh: DeviceMesh, block_kernel: BlockAttentionKernel | None = None) -> None:
        """Args:
        mesh: The 1-D context-parallel mesh.
        block_kernel: The kernel of the unmasked causal path; None picks one by the tensors'
            device, dtype and head size (``block_attention_kernel_for``).
        """
        require_one_dim(mesh, purpose="ContextParallelAttention")
        self._mesh = mesh
        self._block_kernel = block_kernel

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
        """Attends this rank's queries to the whole sequence; see the class docstring.

        Raises:
            ValueError: If the local length is odd, the head counts do not divide or
                ``sliding_window`` is not positive.
        """
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"ContextParallelAttention: sliding_window={sliding_window} must be positive")
        cp = self._mesh.size()
        local_len = query.shape[1]
        length = local_len * cp
        if local_len % 2 != 0:
            raise ValueError(
                f"ContextParallelAttention: local sequence length {local_len} is odd; shard sequences "
                f"of a length divisible by 2 * cp = {2 * cp} with context_parallel_shard"
            )
        q_heads, kv_heads = query.shape[2], key.shape[2]
        if q_heads % kv_heads != 0:
            raise ValueError(f"query heads {q_heads} are not a multiple of key/value heads {kv_heads}")
        # One collective for both (and one reduce-scatter in the backward).
        key_value = gather_sequence(torch.stack((key, value)), mesh=self._mesh, seq_dim=2)
        full_key, full_value = key_value.unbind(0)
        if sliding_window is None and document_ids is None:
            kernel = self._block_kernel or block_attention_kernel_for(query)
            return _attend_unmasked(
                query,
                full_key,
                full_value,
                causal=causal,
                softmax_scale=softmax_scale,
                chunk_indices=(self._mesh.get_local_rank(), 2 * cp - 1 - self._mesh.get_local_rank()),
                kernel=kernel,
            )
        q_pos = local_positions(length, cp, self._mesh.get_local_rank(), device=query.device)
        distance = q_pos.unsqueeze(1) - torch.arange(length, device=query.device).unsqueeze(0)
        allowed = torch.ones(local_len, length, dtype=torch.bool, device=query.device)
        if causal:
            allowed &= distance >= 0
        if sliding_window is not None:
            allowed &= distance.abs() < sliding_window
        mask = allowed.unsqueeze(0)
        if document_ids is not None:
            full_docs = gather_sequence(document_ids, mesh=self._mesh)
            mask = mask & (document_ids.unsqueeze(2) == full_docs.unsqueeze(1))
        k = expand_heads(full_key, q_heads, dim=2).transpose(1, 2)
        v = expand_heads(full_value, q_heads, dim=2).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1), scale=softmax_scale
        )
        return out.transpose(1, 2)


def _attend_unmasked(
    query: torch.Tensor,
    full_key: torch.Tensor,
    full_value: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    chunk_indices: tuple[int, int],
    kernel: BlockAttentionKernel | None,
) -> torch.Tensor:
    """Attention of the local queries without a mask tensor (no window, no documents).

    Causal: the local part is two chunks of the sequence (``chunk_indices``); chunk ``c`` of
    length ``n`` sees keys ``[0, (c + 1) * n)`` and, within that range, query ``i`` sees key ``j``
    iff ``j <= i + c * n``: the lower-right aligned causal mask of an ``n x (c + 1) * n`` block.
    """
    q, k, v = query.transpose(1, 2), full_key.transpose(1, 2), full_value.transpose(1, 2)
    q_heads = query.shape[2]
    if not causal:
        out = nn.functional.scaled_dot_product_attention(
            q,
            expand_heads(full_key, q_heads, dim=2).transpose(1, 2),
            expand_heads(full_value, q_heads, dim=2).transpose(1, 2),
            scale=softmax_scale,
        )
        return out.transpose(1, 2)
    chunk = query.shape[1] // 2
    parts: list[torch.Tensor] = []
    for part, index in enumerate(chunk_indices):
        q_part = q[:, :, part * chunk : (part + 1) * chunk]
        if kernel is not None:
            out = attend_chunk_causally(q_part, k, v, start=index * chunk, scale=softmax_scale, kernel=kernel)
        else:
            end = (index + 1) * chunk
            out = nn.functional.scaled_dot_product_attention(
                q_part,
                expand_heads(full_key[:, :end], q_heads, dim=2).transpose(1, 2),
                expand_heads(full_value[:, :end], q_heads, dim=2).transpose(1, 2),
                attn_mask=CausalBias(CausalVariant.LOWER_RIGHT, chunk, end),
                scale=softmax_scale,
            )
        parts.append(out.transpose(1, 2))
    return torch.cat(parts, dim=1)


def parallelize_context_parallel(attention: AttentionLayerLike, *, mesh: DeviceMesh) -> None:
    """Installs ``ContextParallelAttention`` in an attention layer's ``attention_backend`` slot.

    The layer then takes this rank's part of the sequence (shard inputs, position ids and
    document ids with ``context_parallel_shard`` / ``context_parallel_position_ids``). Its
    parameters are untouched: replicate or shard them over the cp ranks as for data
    parallelism (``parallelize_replicate`` / ``parallelize_hsdp`` over a mesh including cp).
    """
    attention.attention_backend = ContextParallelAttention(mesh=mesh)
