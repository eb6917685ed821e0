"""Paged decode attention as a ``torch.library`` custom op (inference only: no autograd).

Eager calls launch the kernels directly (less host time per decode step than the custom-op
dispatcher); under ``torch.compile`` the custom op keeps the kernels opaque to Inductor.
"""

from __future__ import annotations

import torch

from d9d.kernels._backend import KernelBackend
from d9d.kernels._paged_attention_inputs import PagedDecodeInputs
from d9d.kernels._triton.launch import interpreted

# Programs per SM the split count aims at: enough to hide a program's tail behind another's loads.
_PROGRAMS_PER_SM = 2
# Splits every row gets at least (as its capacity allows): rows of unequal lengths (a rollout's) leave
# SMs idle behind the longest rows with one program each; at 64 ragged rows four splits were ~10%
# faster on the H200 (bench_paged_attention.py --ragged-only).
_MIN_SPLITS = 4
# The floor with the rows started longest first (row_order): at 64 and 256 rollout rows on the H200
# three splits were the fastest of one to five, 2-4% faster than four in row order.
_MIN_SPLITS_ORDERED = 3
# More splits than this only adds combine work; 64 already gives 128-token splits of an 8k context.
_MAX_SPLITS = 64


def block_size(dtype: torch.dtype) -> int:
    """Positions per inner-loop step: ``tl.dot``'s minimum in the interpreter, 64 (32 in fp32) on GPU."""
    if interpreted():
        return 16
    return 32 if dtype == torch.float32 else 64


def splits_for(
    programs: int, capacity: int, block_n: int, *, multiprocessors: int, ordered: bool = False
) -> int:
    """How many programs share one (row, kv head): enough to give every SM work on short batches, and
    at least four (three with the rows started longest first: ``ordered``), so that rows of unequal
    lengths balance over the SMs.

    Taken from static sizes only (``programs = rows * kv_heads`` and the block table's ``capacity =
    max_blocks * page_size`` positions per row, never a row's length), so the launch is the same on
    every decode step and a CUDA graph replays it. No split is narrower than one ``block_n`` step.
    """
    wanted = max(
        _MIN_SPLITS_ORDERED if ordered else _MIN_SPLITS,
        -(-_PROGRAMS_PER_SM * multiprocessors // max(1, programs)),
    )
    useful = -(-capacity // block_n)
    return max(1, min(wanted, useful, _MAX_SPLITS))


@torch.library.custom_op("d9d_kernels::paged_decode_attention", mutates_args=())
def _paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    sinks: torch.Tensor | None,
    row_order: torch.Tensor | None,
    page_size: int,
    softmax_scale: float,
    sliding_window: int | None,
    num_splits: int,
    block_n: int,
) -> torch.Tensor:
    from d9d.kernels._triton.paged_attention_kernels import paged_decode_attention_kernel

    inputs = PagedDecodeInputs(
        query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table, lengths=lengths,
        page_size=page_size, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks,
        row_order=row_order,
    )  # fmt: skip
    return paged_decode_attention_kernel(inputs, num_splits, block_n)


@_paged_decode_attention.register_fake
def _paged_decode_attention_fake(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    sinks: torch.Tensor | None,
    row_order: torch.Tensor | None,
    page_size: int,
    softmax_scale: float,
    sliding_window: int | None,
    num_splits: int,
    block_n: int,
) -> torch.Tensor:
    return query.new_empty((query.shape[0], query.shape[1], value_cache.shape[2]))


def paged_decode_attention_triton(
    inputs: PagedDecodeInputs, *, num_splits: int | None = None
) -> torch.Tensor:
    """Paged decode attention through the Triton kernels; see ``d9d.kernels.paged_decode_attention``.

    Args:
        inputs: The op's checked arguments.
        num_splits: Programs per (row, kv head); None picks ``splits_for``'s (tests force it).
    """
    from d9d.kernels._triton.paged_attention_kernels import paged_decode_attention_kernel
    from d9d.kernels._triton.rms_norm_kernels import multiprocessor_count

    block_n = block_size(inputs.query.dtype)
    if num_splits is None:
        sms = multiprocessor_count(inputs.query.device)
        num_splits = splits_for(
            inputs.rows * inputs.kv_heads, inputs.capacity, block_n, multiprocessors=sms,
            ordered=inputs.row_order is not None,
        )  # fmt: skip
    if torch.compiler.is_compiling():
        # the custom op mutates nothing (a mutating one would have its pool functionalized): the
        # compiled step writes with index_copy_ (and normalizes and rotates with qk_norm_rope's
        # separate ops), which Inductor fuses with their neighbours
        inputs = inputs.normalized(KernelBackend.AUTO)
        inputs.write()
        i = inputs
        return _paged_decode_attention(
            i.query, i.key_cache, i.value_cache, i.block_table, i.lengths, i.sinks, i.row_order,
            i.page_size, i.softmax_scale, i.sliding_window, num_splits, block_n,
        )  # fmt: skip
    return paged_decode_attention_kernel(inputs, num_splits, block_n)
