"""Decode attention straight from a paged key/value pool: the public op."""

from __future__ import annotations

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._reference.paged_attention import paged_decode_attention_reference

_OP = "paged_decode_attention"


def _check_shapes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
) -> None:
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dim() != 3:
            raise ValueError(f"{_OP}: {name} must be 3-D, got shape {tuple(t.shape)}")
    rows, q_heads, head_dim = query.shape
    num_slots, kv_heads, key_dim = key_cache.shape
    if tuple(value_cache.shape[:2]) != (num_slots, kv_heads):
        raise ValueError(
            f"{_OP}: value_cache shape {tuple(value_cache.shape)} does not match key_cache "
            f"{tuple(key_cache.shape)} in (num_slots, kv_heads)"
        )
    if key_dim != head_dim:
        raise ValueError(f"{_OP}: key_cache head_dim {key_dim} differs from query head_dim {head_dim}")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"{_OP}: query heads {q_heads} are not a multiple of key_cache kv_heads {kv_heads}")
    if page_size < 1 or num_slots % page_size != 0:
        raise ValueError(f"{_OP}: page_size={page_size} does not divide key_cache's {num_slots} slots")
    if block_table.dim() != 2 or block_table.shape[0] != rows:
        raise ValueError(
            f"{_OP}: block_table must be (rows={rows}, max_blocks), got {tuple(block_table.shape)}"
        )
    if tuple(lengths.shape) != (rows,):
        raise ValueError(f"{_OP}: lengths must be (rows={rows},), got {tuple(lengths.shape)}")


def _check_types(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    sinks: torch.Tensor | None,
) -> None:
    if not query.is_floating_point() or key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(
            f"{_OP}: query, key_cache and value_cache must share one floating dtype, got {query.dtype}, "
            f"{key_cache.dtype}, {value_cache.dtype}"
        )
    for name, t in (("block_table", block_table), ("lengths", lengths)):
        if t.dtype != torch.int32:
            raise ValueError(f"{_OP}: {name} must be int32, got {t.dtype}")
    tensors = [("key_cache", key_cache), ("value_cache", value_cache), ("block_table", block_table)]
    tensors += [("lengths", lengths)] + ([("sinks", sinks)] if sinks is not None else [])
    for name, t in tensors:
        if t.device != query.device:
            raise ValueError(f"{_OP}: {name} is on {t.device}, query on {query.device}")
    if sinks is not None and (tuple(sinks.shape) != (query.shape[1],) or not sinks.is_floating_point()):
        raise ValueError(
            f"{_OP}: sinks must be a floating (q_heads={query.shape[1]},) tensor, got {tuple(sinks.shape)} "
            f"{sinks.dtype}"
        )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    page_size: int,
    softmax_scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: KernelBackend = KernelBackend.AUTO,
) -> torch.Tensor:
    """Attention of one new query token per row over that row's keys and values in a paged pool.

    The pool holds ``num_slots = num_blocks * page_size`` slots; position ``p`` of row ``r`` lives in
    slot ``block_table[r, p // page_size] * page_size + p % page_size``. The Triton kernel reads the
    keys and values in place (no gathered copy), splits long rows over several programs to fill the
    GPU and merges the splits with their log-sum-exp; the softmax runs in fp32. Neither path reads a
    tensor's values on the host or allocates by them, so a decode step that calls this can be
    captured in a CUDA graph. Block-table entries past a row's length are never read. Not
    differentiable (inference only).

    Args:
        query: ``(rows, q_heads, head_dim)``, the rows' new tokens, already rotated.
        key_cache: ``(num_slots, kv_heads, head_dim)``, with the new tokens' keys already written.
        value_cache: ``(num_slots, kv_heads, value_dim)``; ``value_dim`` may differ from
            ``head_dim`` (multi-head latent attention).
        block_table: ``(rows, max_blocks)`` int32, row ``r``'s ``i``-th block id.
        lengths: ``(rows,)`` int32, tokens cached for each row including the new one; ``0`` marks an
            idle padding row, whose output is zeros. At most ``max_blocks * page_size``.
        page_size: Slots per block.
        softmax_scale: Score multiplier (usually ``head_dim ** -0.5``).
        sliding_window: The query at position ``length - 1`` sees only positions greater than
            ``length - 1 - sliding_window``; None sees the whole row.
        sinks: ``(q_heads,)`` attention-sink logits (GPT-OSS): an extra softmax column with no value,
            as in ``d9d.kernels.layers.sdpa_with_sinks``.
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        ``(rows, q_heads, value_dim)`` in ``query``'s dtype. Query head ``h`` attends with key/value
        head ``h // (q_heads // kv_heads)``.

    Raises:
        ValueError: A tensor's rank, shape, dtype or device does not fit the others, ``page_size``
            does not divide the pool, or ``sliding_window`` is below 1.
        RuntimeError: ``backend`` is TRITON where the kernels cannot run (no Triton, no CUDA device
            outside the interpreter).
    """
    _check_shapes(query, key_cache, value_cache, block_table, lengths, page_size)
    _check_types(query, key_cache, value_cache, block_table, lengths, sinks)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{_OP}: sliding_window={sliding_window} must be at least 1")
    floats = (query, key_cache, value_cache) + ((sinks,) if sinks is not None else ())
    if use_triton(backend, _OP, *floats):
        from d9d.kernels._triton.paged_attention_op import paged_decode_attention_triton

        return paged_decode_attention_triton(
            query, key_cache, value_cache, block_table, lengths,
            page_size=page_size, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks,
        )  # fmt: skip
    return paged_decode_attention_reference(
        query, key_cache, value_cache, block_table, lengths,
        page_size=page_size, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks,
    )  # fmt: skip
