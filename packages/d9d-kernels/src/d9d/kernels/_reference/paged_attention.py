"""Decode attention over a paged key/value pool in plain PyTorch.

Every row gathers the same number of slots (its whole block table), and the positions a row does
not see are masked, so no shape depends on the lengths' values: the reference, too, runs without
a host sync (and can be captured in a CUDA graph).
"""

from __future__ import annotations

import torch

from d9d.kernels._paged_attention_inputs import PagedDecodeInputs
from d9d.kernels._reference.precision import upcast


def visible_positions(lengths: torch.Tensor, capacity: int, sliding_window: int | None) -> torch.Tensor:
    """``(rows, capacity)`` bool: position ``p`` of a row is visible to its query at ``length - 1``.

    Visible means ``p < length`` and, with a window, ``p > length - 1 - sliding_window``.
    """
    positions = torch.arange(capacity, device=lengths.device)[None]
    ends = lengths.to(torch.int64)[:, None]
    visible = positions < ends
    if sliding_window is not None:
        visible = visible & (positions >= ends - sliding_window)
    return visible


def paged_decode_attention_reference(inputs: PagedDecodeInputs) -> torch.Tensor:
    """Gathers each row's slots through its block table and attends with a masked fp32 softmax.

    Shapes as in ``d9d.kernels.paged_decode_attention``; rows whose query sees no key (length 0)
    get zeros. Slots of positions a row does not see are replaced by slot 0 before the gather, so
    block-table entries past a row's length may hold anything.
    """
    rows, kv_heads, group, capacity = inputs.rows, inputs.kv_heads, inputs.group, inputs.capacity
    page_size, sinks = inputs.page_size, inputs.sinks
    visible = visible_positions(inputs.lengths, capacity, inputs.sliding_window)
    positions = torch.arange(capacity, device=inputs.query.device)
    blocks = inputs.block_table.to(torch.int64)[:, positions // page_size]
    slots = torch.where(visible, blocks * page_size + positions % page_size, 0)
    keys = upcast(inputs.key_cache[slots])  # (rows, capacity, kv_heads, head_dim)
    values = upcast(inputs.value_cache[slots])  # (rows, capacity, kv_heads, value_dim)
    grouped = upcast(inputs.query).view(rows, kv_heads, group, inputs.head_dim)
    scores = torch.einsum("rkgd,rtkd->rkgt", grouped, keys) * inputs.softmax_scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink_column = upcast(sinks).view(1, kv_heads, group, 1).expand(rows, -1, -1, 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., :capacity]
    # a row that sees nothing softmaxes over -inf only (NaN): its output is defined as zeros
    weights = weights.masked_fill(~visible.any(dim=1)[:, None, None, None], 0.0)
    out = torch.einsum("rkgt,rtkv->rkgv", weights, values)
    return out.reshape(rows, inputs.q_heads, inputs.value_dim).to(inputs.query.dtype)
