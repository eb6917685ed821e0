"""Eager attention: the explicit-matrix reference every other backend is checked against."""

from __future__ import annotations

import torch

from d9d.kernels.layers._attention_mask import build_attention_mask
from d9d.kernels.layers._attention_sinks import check_sinks


def check_attention_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Validates the slot's shapes and returns the number of query heads per key head."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            f"attention expects (batch, seq, heads, head_dim) tensors, got query {tuple(query.shape)}, "
            f"key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key.shape != value.shape:
        raise ValueError(f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}")
    if query.shape[0] != key.shape[0] or query.shape[1] != key.shape[1] or query.shape[3] != key.shape[3]:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} differ in batch, seq or head_dim"
        )
    q_heads, kv_heads = query.shape[2], key.shape[2]
    if q_heads % kv_heads != 0:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    return q_heads // kv_heads


class EagerAttentionBackend:
    """Materializes the score matrix in fp32 (fp64 for fp64 inputs): slow, memory-hungry, exact.

    The reference the other backends are tested against; it also attends with sinks
    (``SinkAttentionBackend``).
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
    ) -> torch.Tensor:
        """See ``AttentionBackend.attend``."""
        return self._attend(query, key, value, None, causal, softmax_scale, sliding_window, document_ids)

    def attend_with_sinks(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        sinks: torch.Tensor,
        causal: bool,
        softmax_scale: float,
        sliding_window: int | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See ``SinkAttentionBackend.attend_with_sinks``: the sink is one more score column."""
        check_sinks(sinks, query.shape[2])
        return self._attend(query, key, value, sinks, causal, softmax_scale, sliding_window, document_ids)

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        sinks: torch.Tensor | None,
        causal: bool,
        softmax_scale: float,
        sliding_window: int | None,
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        group = check_attention_shapes(query, key, value)
        batch, seq, q_heads, _ = query.shape
        compute_dtype = torch.promote_types(query.dtype, torch.float32)
        q = query.transpose(1, 2).to(compute_dtype)
        k = key.transpose(1, 2).to(compute_dtype).repeat_interleave(group, dim=1)
        v = value.transpose(1, 2).to(compute_dtype).repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale
        mask = build_attention_mask(
            seq, causal=causal, sliding_window=sliding_window, document_ids=document_ids, device=query.device
        )
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            probabilities = torch.softmax(scores, dim=-1)
        else:
            column = sinks.to(compute_dtype).view(1, q_heads, 1, 1).expand(batch, q_heads, seq, 1)
            probabilities = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        output = torch.matmul(probabilities, v)
        return output.transpose(1, 2).to(query.dtype)
