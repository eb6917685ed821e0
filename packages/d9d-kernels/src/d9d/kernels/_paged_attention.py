"""Decode attention straight from a paged key/value pool: the public op."""

from __future__ import annotations

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._paged_attention_inputs import PagedDecodeInputs
from d9d.kernels._qk_norm_rope import QKNormRope
from d9d.kernels._reference.paged_attention import paged_decode_attention_reference

_OP = "paged_decode_attention"


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
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
    write_slots: torch.Tensor | None = None,
    row_order: torch.Tensor | None = None,
    qk_norm_rope: QKNormRope | None = None,
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
        key_cache: ``(num_slots, kv_heads, head_dim)``, with the new tokens' keys already written
            (or written by this call: ``new_key``).
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
        new_key: ``(rows, kv_heads, head_dim)``: the rows' new keys, those of position
            ``length - 1``, written into ``key_cache`` at ``write_slots`` (that position's slots)
            before the attention, as ``key_cache.index_copy_(0, write_slots, new_key)`` would (a
            decode step's write). The Triton kernel does it in its own launch (two launches fewer
            per layer): the programs of a row read the pool up to the new position and take the
            new key and value from these tensors; one of them stores them. A written slot must
            hold no position that another row sees (an idle row may write a scratch slot no row
            reads). None: the pool already holds the new tokens.
        new_value: ``(rows, kv_heads, value_dim)``, written into ``value_cache`` with ``new_key``.
        write_slots: ``(rows,)`` int64 or int32 slots of ``new_key`` and ``new_value``.
        row_order: ``(rows,)`` int32, a permutation of the rows: the order in which the Triton
            kernel starts their programs. Longest first (``torch.argsort(lengths,
            descending=True)``, once per decode step for all layers) keeps a long row from running
            on alone at the end: 0.5-2% less kernel time at 64 and 256 rollout rows on an H200,
            2-4% with three splits against rows in order with four. The outputs stay in row order
            and do not change; None starts the rows in order.
        qk_norm_rope: Per-head RMSNorm, then the rotation, still to apply to ``query`` and
            ``new_key`` (Qwen3-style attention), with ``cos`` and ``sin`` ``(rows, head_dim)``
            rotating the whole head; needs the write. The Triton kernel applies them as each program
            loads its queries and the new key (one launch fewer per layer than ``qk_norm_rope``
            before the call), rounding as ``qk_norm_rope`` rounds; the pool stores the normalized,
            rotated keys. None: ``query`` and ``new_key`` are final.
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        ``(rows, q_heads, value_dim)`` in ``query``'s dtype. Query head ``h`` attends with key/value
        head ``h // (q_heads // kv_heads)``.

    Raises:
        ValueError: A tensor's rank, shape, dtype or device does not fit the others, ``page_size``
            does not divide the pool, ``sliding_window`` is below 1, or ``qk_norm_rope`` comes
            without the write.
        RuntimeError: ``backend`` is TRITON where the kernels cannot run (no Triton, no CUDA device
            outside the interpreter).
    """
    inputs = PagedDecodeInputs(
        query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table, lengths=lengths,
        page_size=page_size, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks,
        new_key=new_key, new_value=new_value, write_slots=write_slots, row_order=row_order,
        qk_norm_rope=qk_norm_rope,
    )  # fmt: skip
    inputs.check()
    if use_triton(backend, _OP, *inputs.floats):
        from d9d.kernels._triton.paged_attention_op import paged_decode_attention_triton

        return paged_decode_attention_triton(inputs)
    inputs = inputs.normalized(KernelBackend.REFERENCE)
    inputs.write()  # the reference reads the pool only
    return paged_decode_attention_reference(inputs)
