"""Attention sinks: a learned logit per query head that joins the softmax denominator, with no value.

With sink logit ``s_h`` of head ``h``, a query's weights are ``exp(score_j) / (exp(s_h) + sum_k
exp(score_k))``: the weights sum to less than one, so a head can attend to "nothing" (GPT-OSS).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class SinkAttentionBackend(Protocol):
    """An ``AttentionBackend`` that also attends with per-head sinks (eager and SDPA here).

    ``GroupedQueryAttention(sinks=True)`` needs its backend to fit this; the mask arguments mean
    what ``AttentionBackend`` defines.
    """

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
        """``AttentionBackend.attend`` with ``sinks``, ``(q_heads,)`` logits in the denominator."""
        ...


def check_sinks(sinks: torch.Tensor, q_heads: int) -> None:
    """Raises unless ``sinks`` holds one logit per query head."""
    if sinks.shape != (q_heads,):
        raise ValueError(
            f"attention sinks have shape {tuple(sinks.shape)}, expected ({q_heads},): one logit per "
            "query head (under tensor parallelism, shard the sinks with the heads)"
        )


def sdpa_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    sinks: torch.Tensor,
    *,
    softmax_scale: float,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with sinks, exactly: one extra all-zero key and value per row.

    The extra key scores ``0`` against every query; an additive mask puts the head's sink logit on
    it (and ``-inf`` on the keys ``allowed`` forbids), and its zero value adds nothing to the
    output. The gradient reaches ``sinks`` through the mask.

    Args:
        query: ``(batch, q_heads, q_len, head_dim)``.
        key: ``(batch, kv_heads, k_len, head_dim)``.
        value: Same shape as ``key``.
        allowed: ``(batch or 1, 1, q_len, k_len)`` bool, True where a query may see a key.
        sinks: ``(q_heads,)``.
        softmax_scale: Score multiplier.

    Returns:
        ``(batch, q_heads, q_len, head_dim)``.
    """
    batch, q_heads, q_len, _ = query.shape
    check_sinks(sinks, q_heads)
    group = q_heads // key.shape[1]
    # expanded heads rather than enable_gqa: PyTorch's memory-efficient kernel (masks) takes no GQA
    zeros = key.new_zeros((*key.shape[:2], 1, key.shape[3]))
    keys = torch.cat([key, zeros], dim=2).repeat_interleave(group, dim=1)
    values = torch.cat([value, zeros], dim=2).repeat_interleave(group, dim=1)
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    bias = bias.masked_fill(~allowed, float("-inf")).expand(batch, q_heads, q_len, allowed.shape[-1])
    sink_column = sinks.to(query.dtype).view(1, q_heads, 1, 1).expand(batch, q_heads, q_len, 1)
    return F.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=torch.cat([bias, sink_column], dim=-1),
        scale=softmax_scale,
    )
