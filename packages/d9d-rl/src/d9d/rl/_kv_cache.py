"""Incremental decoding of a d9d-hf decoder model (any family) over a paged key/value cache.

Every layer's keys and values live in one pool of fixed-size blocks; a row owns a list of
blocks (its block table) that grows with its tokens. A forward runs the new tokens of a batch of
rows, each from its own cached length: each decoder layer runs its own forward with its
attention's ``kv_cache`` slot (d9d-kernels' ``KeyValueCache``) filled by this layer's paged view,
which scatters the new keys and values into the rows' blocks and gathers each row's blocks back
into a contiguous view for attention. Generation thus uses the model's code and the trainer's
weights, whatever the family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch._dynamo.exc import (  # pyright: ignore[reportPrivateUsage]
    FailOnRecompileLimitHit,
    TorchDynamoException,
)
from torch.fx.experimental import _config as fx_config  # pyright: ignore[reportPrivateUsage]

from d9d.hf import DecoderCausalLM
from d9d.rl._engine_compile import compile_engine_region
from d9d.rl._engine_config import CompileBackend
from d9d.rl._pinned_copy import to_device


@dataclass(kw_only=True)
class PagedKVCache:
    """Keys and values of every layer in ``num_blocks`` blocks of ``page_size`` tokens, plus one.

    The extra last block is scratch: no row owns it; the idle rows of a static decode step write
    their keys and values there.

    Attributes:
        keys: Per layer, ``((num_blocks + 1) * page_size, kv_heads, head_dim)``; block ``b``
            holds rows ``b * page_size ..`` of it.
        values: Same shape as ``keys``.
        page_size: Tokens per block.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    page_size: int

    @property
    def num_blocks(self) -> int:
        """Blocks rows may own (the scratch block not counted)."""
        return self.keys[0].shape[0] // self.page_size - 1

    @classmethod
    def empty(
        cls, model: DecoderCausalLM, *, num_blocks: int, page_size: int, device: torch.device
    ) -> PagedKVCache:
        """Allocates the pool (and the scratch block) for ``model``'s layers in the dtype of its weights.

        Zeroed: a slot not yet written holds finite values, so an attention that weighs it by
        exactly zero (a masked position) stays finite.
        """
        layers = model.model.decoder_layers()
        dtype = next(p.dtype for p in layers[0].parameters() if p.is_floating_point())
        shape = ((num_blocks + 1) * page_size, model.spec.num_kv_heads, model.spec.head_dim)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in layers],
            page_size=page_size,
        )


@dataclass(kw_only=True, frozen=True)
class PagedBatch:
    """The rows of one forward over the paged cache.

    Attributes:
        tokens: Per row, its new tokens (a whole prompt when admitted, then one per step).
        starts: Per row, its tokens already in the cache (the new ones go after them).
        blocks: Per row, its block table: enough blocks for ``start + len(tokens)`` tokens.
    """

    tokens: list[list[int]]
    starts: list[int]
    blocks: list[list[int]]


@dataclass(kw_only=True)
class _StepIndices:
    """Where a forward's new tokens go in the pool and which cached slots each query sees."""

    new_flat: torch.Tensor  # the real new tokens' indices in the flattened (rows, new) positions
    write: torch.Tensor
    read: torch.Tensor
    visible: torch.Tensor
    distance: torch.Tensor
    padding_sees_first: torch.Tensor
    masks: dict[int | None, torch.Tensor]  # built once per sliding window, shared by its layers

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``(rows, 1, new, total)``: causal over a row's slots, within the window; a padding
        query sees slot 0 only (so it never softmaxes over nothing)."""
        mask = self.masks.get(sliding_window)
        if mask is None:
            allowed = self.visible
            if sliding_window is not None:
                allowed = allowed & (self.distance < sliding_window)
            mask = (allowed | self.padding_sees_first)[:, None]
            self.masks[sliding_window] = mask
        return mask


@dataclass(kw_only=True, frozen=True)
class PagedInputs:
    """A ``PagedBatch`` on the device: the small tables ``paged_logits`` derives the rest from.

    Attributes:
        input_ids: ``(rows, width)`` int64 new tokens, padded to the longest row's.
        table: ``(rows, columns)`` int64 block tables, padded with block 0 (to two columns at least).
        starts: ``(rows, 1)`` int64, each row's tokens already in the cache.
        counts: ``(rows, 1)`` int64, each row's new tokens.
        new_flat: The real new tokens' indices in the flattened ``(rows, width)`` positions.
        slots: ``(total,)`` int64 ``0 .. total - 1``: every row's slots after this forward.
    """

    input_ids: torch.Tensor
    table: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    new_flat: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def of(cls, batch: PagedBatch, pad_token_id: int, device: torch.device) -> PagedInputs:
        """Builds the tables on the host and copies them from pinned memory without waiting for
        the device. Nothing downstream reads the device back: the real new tokens are picked by
        indices built here (``new_flat``), not by a boolean mask, whose indexing would wait for the
        device at every layer and leave it idle while the host launches the next kernels."""
        lengths = [len(row) for row in batch.tokens]
        width = max(lengths)
        # at least two columns: a size of 1 would be specialized, a graph of its own when compiled
        table_width = max(2, *(len(blocks) for blocks in batch.blocks))
        total = max(start + length for start, length in zip(batch.starts, lengths, strict=True))
        ids = [[*row, *[pad_token_id] * (width - len(row))] for row in batch.tokens]
        blocks = [[*row, *[0] * (table_width - len(row))] for row in batch.blocks]
        new_flat = [row * width + column for row, length in enumerate(lengths) for column in range(length)]
        return cls(
            input_ids=to_device(ids, device),
            table=to_device(blocks, device),
            starts=to_device([[start] for start in batch.starts], device),
            counts=to_device([[length] for length in lengths], device),
            new_flat=to_device(new_flat, device),
            slots=torch.arange(total, device=device),
        )


@dataclass(kw_only=True, frozen=True)
class _PagedLayerView:
    """A layer's view of the pool: d9d-kernels' ``KeyValueCache`` slot of its attention."""

    keys: torch.Tensor
    values: torch.Tensor
    step: _StepIndices

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatters the real new tokens into their blocks; gathers every row's slots so far."""
        keys, values = self.keys, self.values
        new = self.step.new_flat
        keys.index_copy_(0, self.step.write, key.flatten(0, 1)[new].to(keys.dtype))
        values.index_copy_(0, self.step.write, value.flatten(0, 1)[new].to(values.dtype))
        return keys[self.step.read], values[self.step.read]

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        """The step's mask for the new tokens (shared by the layers with the same window)."""
        return self.step.attention_mask(sliding_window)


PrefillFunction = Callable[
    [
        DecoderCausalLM,
        list[torch.Tensor],
        list[torch.Tensor],
        int,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
    ],
    torch.Tensor,
]
"""``paged_logits``'s signature: the eager function or its compiled form."""


def paged_logits(
    model: DecoderCausalLM,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    page_size: int,
    input_ids: torch.Tensor,
    table: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    new_flat: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The model part of ``forward_paged`` over ``PagedInputs``' tables (their fields in order).

    ``new_flat`` may also select padding positions (a prefill of a static width, ``StaticPrefill``):
    their keys and values go to the pool's scratch block, and their queries see slot 0 only.

    Returns:
        ``(rows, vocab)`` float32 next-token logits at each row's last new token.
    """
    backbone = model.model
    lm_head, norm = model.lm_head, backbone.norm
    if lm_head is None or norm is None:
        raise RuntimeError("generation needs the whole model (first and last pipeline stage)")
    rows, width = input_ids.shape
    columns = torch.arange(width, device=input_ids.device)[None]
    new_valid = columns < counts
    positions = starts + columns
    every_slot = slots[None].expand(rows, -1)

    def flat(logical: torch.Tensor) -> torch.Tensor:
        return table.gather(1, logical // page_size) * page_size + logical % page_size

    distance = positions[:, :, None] - every_slot[:, None, :]
    # padding that new_flat selects (a static-width prefill) writes to the scratch block
    scratch = keys[0].shape[0] - page_size
    step = _StepIndices(
        new_flat=new_flat,
        write=torch.where(new_valid, flat(positions.where(new_valid, 0)), scratch).flatten()[new_flat],
        read=flat(every_slot.where(every_slot < starts + counts, 0)),
        visible=distance >= 0,
        distance=distance,
        padding_sees_first=~new_valid[:, :, None] & (every_slot[:, None, :] == 0),
        masks={},
    )
    hidden = backbone.embed(input_ids)
    tables = backbone.position_embeddings(positions, dtype=hidden.dtype)
    for index, (layer, position_embeddings) in enumerate(zip(backbone.decoder_layers(), tables, strict=True)):
        view = _PagedLayerView(keys=keys[index], values=values[index], step=step)
        hidden = layer(hidden, position_embeddings, None, kv_cache=view)
    last = hidden[torch.arange(rows, device=hidden.device), counts[:, 0] - 1][:, None]
    return lm_head.compute_logits(norm(last))[:, -1].float()


def compile_paged_logits(max_rows: int, backend: CompileBackend) -> PrefillFunction:
    """``paged_logits`` through ``torch.compile`` (one graph, every size dynamic), for one engine.

    A prefill runs the model over a batch's whole prompts once, so eagerly its time is mostly the
    host launching a few hundred small kernels one by one; compiled, the elementwise work fuses
    and the host runs one generated wrapper. One row has a graph of its own (a size of 1 is always
    specialized), the other row counts, widths, contexts and pool sizes share one
    (``compile_engine_region``, with two graphs of headroom).

    Args:
        max_rows: The engine's ``max_rows`` (more rows than one: a second graph).
        backend: ``torch.compile``'s backend (``EmbeddedEngineConfig.compile_backend``).
    """
    graphs = 2 if max_rows > 1 else 1
    return compile_engine_region(
        cast(PrefillFunction, paged_logits), recompile_limit=graphs + 2, backend=backend, dynamic=True
    )  # two graphs of headroom


def forward_paged(
    model: DecoderCausalLM,
    cache: PagedKVCache,
    batch: PagedBatch,
    *,
    pad_token_id: int,
    compiled: PrefillFunction | None = None,
) -> torch.Tensor:
    """Runs ``batch``'s new tokens through ``model``, storing their keys and values in ``cache``.

    Args:
        model: The whole model.
        cache: The pool the rows' blocks live in.
        batch: The rows' new tokens, cached lengths and block tables.
        pad_token_id: Input token of the padding after a row's new tokens.
        compiled: ``compile_paged_logits``'s function, or None: eager.

    Returns:
        ``(rows, vocab)`` float32 next-token logits at each row's last new token.

    Raises:
        RuntimeError: If the compiled forward fails to compile.
    """
    inputs = PagedInputs.of(batch, pad_token_id, cache.keys[0].device)
    return run_paged_logits(model, cache, inputs, compiled)


def run_paged_logits(
    model: DecoderCausalLM, cache: PagedKVCache, inputs: PagedInputs, compiled: PrefillFunction | None
) -> torch.Tensor:
    """``paged_logits`` over ``inputs``, eagerly or through ``compiled``; see ``forward_paged``."""
    arguments = (
        model, cache.keys, cache.values, cache.page_size,
        inputs.input_ids, inputs.table, inputs.starts, inputs.counts, inputs.new_flat, inputs.slots,
    )  # fmt: skip
    if compiled is None:
        return paged_logits(*arguments)
    try:
        # no "duck" sizes: inputs whose sizes happen to be equal once would be assumed equal always
        with fx_config.patch(use_duck_shape=False):  # pyright: ignore[reportAttributeAccessIssue]
            return compiled(*arguments)
    except (TorchDynamoException, FailOnRecompileLimitHit) as error:
        raise RuntimeError(
            f"compiling the engine's prefill ({inputs.input_ids.shape[0]} rows) with torch.compile failed: "
            f"{error}. Run the engine without it: EmbeddedEngineConfig(compile_prefill=False)"
        ) from error
