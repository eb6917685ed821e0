"""A decode step with static shapes over device-resident state: one new token for each of ``rows`` rows.

The state (each row's input token, length, position, write slot and block table) lives in
persistent device buffers for ``max_rows`` rows; the host changes it through one packed int32
copy per step (``load``), and a row's input token may instead come from the previous step's
sampled tokens, still on the device. ``forward(rows)`` then runs the model on the first ``rows`` rows and
reads nothing else from the host, so the same call can be captured in a CUDA graph and replayed
(``GraphedDecodeStep``). Attention reads the paged pool in place (d9d-kernels'
``paged_decode_attention``); a row of length 0 is idle: its key and value go to the pool's
scratch block and its attention output is zeros. The model part (``decode_rows``) may run
compiled (``compile_decode_rows``): Inductor fuses its elementwise work around the matmuls and the
attention op, and the CUDA graph of a bucket records the compiled kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Literal, cast

import torch
from torch._dynamo import maybe_mark_dynamic  # pyright: ignore[reportPrivateUsage]
from torch._dynamo.exc import (  # pyright: ignore[reportPrivateUsage]
    FailOnRecompileLimitHit,
    TorchDynamoException,
)

from d9d.hf import DecoderCausalLM
from d9d.kernels import FewRowsLinearMode, QKNormRope, paged_decode_attention
from d9d.rl._engine_compile import compile_engine_region
from d9d.rl._engine_config import CompileBackend
from d9d.rl._kv_cache import PagedKVCache

FewRowsLinears = Literal["off", "each", "grouped"]
"""How the decode step's linears run: ``F.linear`` (cuBLAS), d9d-kernels' ``FewRowsLinearMode``
(each linear through the few-rows kernel), or the mode with ``group_projections`` (q/k/v and
gate/up also in one launch each)."""


@dataclass(kw_only=True, frozen=True)
class DecodeUpdate:
    """What one step changes in the device state: the first ``rows`` rows' tokens and lengths
    (idle rows: length 0) and new block-table entries.

    Attributes:
        rows: Rows the step runs (the batch-size bucket).
        order: The buffer row of each decoding sequence, in the caller's order.
        input_ids: Per row, its new token (anything for an idle row).
        lengths: Per row, its tokens including the new one; 0 for an idle row.
        sources: Per row, the index of its new token in the device tokens ``load`` is fed, or -1:
            ``input_ids``. None: every row's token is in ``input_ids``.
        table_rows: Row of each new block-table entry.
        table_columns: Column of each new entry (the row's block index).
        table_blocks: Block id of each new entry.
    """

    rows: int
    order: list[int]
    input_ids: list[int]
    lengths: list[int]
    sources: list[int] | None
    table_rows: list[int]
    table_columns: list[int]
    table_blocks: list[int]


@dataclass(kw_only=True, frozen=True)
class DecodeAttention:
    """How a decode step's attention op runs (``EmbeddedEngineConfig``'s switches of the same names).

    Attributes:
        fused_pool_write: It writes the rows' new keys and values into the pool in its own launch.
        longest_rows_first: It starts the longest rows' programs first (one sort of the lengths per
            step for every layer: ``paged_decode_attention(row_order=...)``).
        fused_qk_norm_rope: It applies the layers' per-head q/k norms and rotation itself
            (``paged_decode_attention(qk_norm_rope=...)``; only with ``fused_pool_write``).
    """

    fused_pool_write: bool = False
    longest_rows_first: bool = False
    fused_qk_norm_rope: bool = False


class StaticDecodeStep:
    """The state buffers of ``max_rows`` rows and the decode forward over the first ``rows`` of them.

    Args:
        model: The whole model.
        cache: The paged pool; its last block is the scratch block (never handed to a row).
        max_rows: Rows the buffers hold.
        max_blocks: Block-table columns per row (blocks of the longest row).
        compiled: ``compile_decode_rows``'s function, shared by the steps of one engine (its
            graphs outlive a pool); every step then reads all ``max_blocks`` columns. None: eager.
        few_rows_linear: How the model part's linears run.
        attention: How the attention op runs.
    """

    def __init__(
        self,
        model: DecoderCausalLM,
        cache: PagedKVCache,
        *,
        max_rows: int,
        max_blocks: int,
        compiled: DecodeFunction | None = None,
        few_rows_linear: FewRowsLinears = "off",
        attention: DecodeAttention | None = None,
    ) -> None:
        if model.lm_head is None or model.model.norm is None:
            raise RuntimeError("generation needs the whole model (first and last pipeline stage)")
        self._model = model
        self.cache = cache
        device = cache.keys[0].device
        self.max_rows = max_rows
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.write_slots = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self._staging = torch.empty(0, dtype=torch.int32, device=device)
        self._compiled = compiled
        self._few_rows_linear: FewRowsLinears = few_rows_linear
        self._attention = attention or DecodeAttention()
        if compiled is not None:
            for tensor in (*cache.keys, *cache.values):
                # the pool's size is dynamic: a later pool of another size reuses the compiled graphs
                maybe_mark_dynamic(tensor, 0)

    @property
    def compiled(self) -> bool:
        """Whether the model part runs compiled."""
        return self._compiled is not None

    def load(self, update: DecodeUpdate, fed: torch.Tensor | None = None) -> torch.Tensor:
        """Sends ``update`` in one host-to-device copy (pinned, asynchronous on CUDA) and applies it.

        The host never waits for the device here: the pinned copy's memory is not reused before
        the copy has run (PyTorch's pinned-memory cache), and ``fed`` is read on the device.

        Args:
            update: The step's changes.
            fed: The device tokens ``update.sources`` index (the previous step's sampled tokens).

        Returns:
            ``update.order`` on the device, int32 (valid until the next ``load``).

        Raises:
            ValueError: If ``update.sources`` and ``fed`` are not both given or both None.
        """
        if (update.sources is None) != (fed is None):
            raise ValueError(
                "a decode update with device-fed rows needs the tokens that feed them, and only then"
            )
        rows, updates, count = update.rows, len(update.table_blocks), len(update.order)
        packed = [
            *update.input_ids,
            *update.lengths,
            *(update.sources or ()),
            *update.order,
            *update.table_rows,
            *update.table_columns,
            *update.table_blocks,
        ]
        device = self.input_ids.device
        host = torch.tensor(packed, dtype=torch.int32, pin_memory=device.type == "cuda")
        if self._staging.numel() < len(packed):
            self._staging = torch.empty(
                max(len(packed), 2 * self._staging.numel()), dtype=torch.int32, device=device
            )
        staging = self._staging[: len(packed)]
        staging.copy_(host, non_blocking=True)
        self.lengths[:rows].copy_(staging[rows : 2 * rows])
        offset = 2 * rows
        if fed is None:
            self.input_ids[:rows].copy_(staging[:rows])
        else:
            sources = staging[offset : offset + rows].long()
            offset += rows
            self.input_ids[:rows].copy_(torch.where(sources >= 0, fed[sources.clamp_min(0)], staging[:rows]))
        if updates:
            table = staging[offset + count :].view(3, updates)
            self.block_table[table[0].long(), table[1].long()] = table[2]
        return staging[offset : offset + count]

    def forward(self, rows: int, blocks: int | None = None) -> torch.Tensor:
        """Next-token logits ``(rows, vocab)`` float32 of the first ``rows`` rows, their keys and
        values written to the pool.

        Args:
            rows: Rows to run (idle ones included).
            blocks: Block-table columns attention may read (at least the longest row's blocks);
                None: all of them (a shape that does not depend on the rows, for CUDA graphs).
                A compiled step always reads all of them.

        Raises:
            RuntimeError: If the compiled step fails to compile.
        """
        cache = self.cache
        state = (
            self.input_ids[:rows],
            self.lengths[:rows],
            self.block_table[:rows, : None if self._compiled is not None else blocks],
            self.positions[:rows],
            self.write_slots[:rows],
        )
        if self._compiled is None:
            return decode_rows(
                self._model, cache.keys, cache.values, cache.page_size, self._few_rows_linear,
                self._attention, *state,
            )  # fmt: skip
        for tensor in state:
            # one graph serves every row count above one (a size of 1 is always specialized)
            maybe_mark_dynamic(tensor, 0)
        try:
            return self._compiled(
                self._model, cache.keys, cache.values, cache.page_size, self._few_rows_linear,
                self._attention, *state,
            )  # fmt: skip
        except (TorchDynamoException, FailOnRecompileLimitHit) as error:
            raise RuntimeError(
                f"compiling the engine's decode step ({rows} rows) with torch.compile failed: {error}. "
                "Run the engine without it: EmbeddedEngineConfig(compile_decode=False)"
            ) from error


DecodeFunction = Callable[
    [
        DecoderCausalLM,
        list[torch.Tensor],
        list[torch.Tensor],
        int,
        FewRowsLinears,
        DecodeAttention,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
    ],
    torch.Tensor,
]
"""``decode_rows``'s signature: the eager function or its compiled form."""


def decode_rows(
    model: DecoderCausalLM,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    page_size: int,
    few_rows_linear: FewRowsLinears,
    attention: DecodeAttention,
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    table: torch.Tensor,
    positions_out: torch.Tensor,
    write_slots_out: torch.Tensor,
) -> torch.Tensor:
    """The model part of a decode step: ``(rows, vocab)`` float32 logits of rows with one new token.

    Args:
        model: The whole model.
        keys: Each layer's key pool ``(num_slots, kv_heads, head_dim)``; its last block is scratch.
        values: Each layer's value pool.
        page_size: Slots per block.
        few_rows_linear: ``"each"``: run the layers and the head under ``FewRowsLinearMode`` (their
            products of at most 16 rows through d9d-kernels' ``few_rows_linear``); ``"grouped"``:
            q/k/v and gate/up in one launch each too; ``"off"``: ``F.linear``.
        attention: How the attention op runs (``DecodeLayerView``).
        input_ids: ``(rows,)`` int64, each row's new token.
        lengths: ``(rows,)`` int32, each row's tokens including the new one; 0: idle.
        table: ``(rows, columns)`` int32 block table.
        positions_out: ``(rows,)`` int64, written: each row's position (``length - 1``, 0 if idle).
        write_slots_out: ``(rows,)`` int64, written: each row's slot for its new key and value (the
            scratch block's first slot if idle).
    """
    backbone = model.model
    lm_head = model.lm_head
    if lm_head is None or backbone.norm is None:
        raise RuntimeError("generation needs the whole model (first and last pipeline stage)")
    positions = (lengths.long() - 1).clamp_min(0)
    slots = (
        table.gather(1, (positions // page_size)[:, None])[:, 0].long() * page_size + positions % page_size
    )
    scratch = keys[0].shape[0] - page_size
    positions_out.copy_(positions)
    write_slots_out.copy_(torch.where(lengths > 0, slots, scratch))
    hidden = backbone.embed(input_ids[:, None])
    tables = backbone.position_embeddings(positions_out[:, None], dtype=hidden.dtype)
    row_order = (
        torch.argsort(lengths, descending=True).to(torch.int32) if attention.longest_rows_first else None
    )
    linears: AbstractContextManager[object]
    match few_rows_linear:
        case "off":
            linears = nullcontext()
        case "each":
            linears = FewRowsLinearMode()
        case "grouped":
            linears = FewRowsLinearMode(group_projections=True)
    views = [
        DecodeLayerView(
            keys=layer_keys,
            values=layer_values,
            page_size=page_size,
            write_slots=write_slots_out,
            block_table=table,
            lengths=lengths,
            attention=attention,
            row_order=row_order,
        )
        for layer_keys, layer_values in zip(keys, values, strict=True)
    ]
    with linears:
        normed = backbone.decode_cached(hidden, tables, views)
        return lm_head.compute_logits(normed)[:, 0].float()


def compile_decode_rows(max_rows: int, backend: CompileBackend) -> DecodeFunction:
    """``decode_rows`` through ``torch.compile`` (the whole step one graph), for one engine.

    Sizes of one row are always specialized, so the steps of one row take a graph of their own;
    the other buckets share one with the row count dynamic (and the pool's size: a rebuilt pool
    reuses the graphs). A guard that splits the buckets further (a kernel's launch picked by the
    row count) recompiles, at most once per bucket: the region's limit is the buckets' count
    (``compile_engine_region``).

    Args:
        max_rows: The engine's ``max_rows`` (buckets: powers of two up to it).
        backend: ``torch.compile``'s backend (``EmbeddedEngineConfig.compile_backend``).
    """
    buckets = (max_rows - 1).bit_length() + 1
    return compile_engine_region(cast(DecodeFunction, decode_rows), recompile_limit=buckets, backend=backend)


def _one_new_token(key: torch.Tensor) -> None:
    if key.shape[1] != 1:
        raise ValueError(f"a decode step takes one new token per row, got {key.shape[1]}")


@dataclass(kw_only=True, frozen=True)
class DecodeLayerView:
    """One layer's pool during a decode step: d9d-kernels' ``NormalizingKeyValueCache``.

    ``attend`` writes the rows' new keys and values at their write slots and runs
    ``paged_decode_attention`` over the pool in place, as ``attention`` says (with
    ``fused_pool_write``, the attention op does the write in its own launch; with
    ``fused_qk_norm_rope`` too, ``attend_normalizing`` takes the layer's per-head q/k norms and
    rotation into that launch; ``row_order`` is the step's one sort for ``longest_rows_first``).
    ``append`` and ``attention_mask`` give the same attention as gathered keys and a mask over every
    block-table column (for a layer that attends itself; the engine's layers go through ``attend``).
    """

    keys: torch.Tensor
    values: torch.Tensor
    page_size: int
    write_slots: torch.Tensor
    block_table: torch.Tensor
    lengths: torch.Tensor
    attention: DecodeAttention = DecodeAttention()
    row_order: torch.Tensor | None = None

    @property
    def takes_qk_norm_rope(self) -> bool:
        """Whether the attention op applies the q/k norms and rotation (only with its write: the
        pool must store the normalized keys)."""
        return self.attention.fused_qk_norm_rope and self.attention.fused_pool_write

    def _write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        _one_new_token(key)
        self.keys.index_copy_(0, self.write_slots, key[:, 0].to(self.keys.dtype))
        self.values.index_copy_(0, self.write_slots, value[:, 0].to(self.values.dtype))

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        softmax_scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """``(rows, 1, q_heads, value_dim)``: the new token of each row attends to its cached ones.

        With ``attention.fused_pool_write`` the attention op writes the new keys and values itself (in its own
        launch on the GPU); otherwise two ``index_copy_`` calls write them first."""
        return self._attend(
            query, key, value, None, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks
        )

    def attend_normalizing(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        qk_norm_rope: QKNormRope,
        *,
        softmax_scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """``attend`` with the per-head q/k norms and the rotation applied by the attention op
        (``paged_decode_attention(qk_norm_rope=...)``) to the projected ``query`` and ``key``."""
        if not self.takes_qk_norm_rope:
            raise RuntimeError(
                "this decode step's attention does not apply the q/k norms (takes_qk_norm_rope)"
            )
        tables = replace(qk_norm_rope, cos=qk_norm_rope.cos[:, 0], sin=qk_norm_rope.sin[:, 0])
        return self._attend(
            query, key, value, tables, softmax_scale=softmax_scale, sliding_window=sliding_window, sinks=sinks
        )

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        qk_norm_rope: QKNormRope | None,
        *,
        softmax_scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        fused = self.attention.fused_pool_write
        if fused:
            _one_new_token(key)
        else:
            self._write(key, value)
        out = paged_decode_attention(
            query[:, 0].to(self.keys.dtype),
            self.keys,
            self.values,
            self.block_table,
            self.lengths,
            page_size=self.page_size,
            softmax_scale=softmax_scale,
            sliding_window=sliding_window,
            sinks=sinks,
            new_key=key[:, 0].to(self.keys.dtype) if fused else None,
            new_value=value[:, 0].to(self.values.dtype) if fused else None,
            write_slots=self.write_slots if fused else None,
            row_order=self.row_order,
            qk_norm_rope=qk_norm_rope,
        )
        return out[:, None].to(query.dtype)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new tokens; returns every row's keys and values over all its table's slots."""
        self._write(key, value)
        slots = self._slots()
        return self.keys[slots], self.values[slots]

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``(rows, 1, 1, columns * page_size)``: a row's positions below its length (and within the
        window); an idle row sees slot 0 only (so it never softmaxes over nothing)."""
        capacity = self.block_table.shape[1] * self.page_size
        positions = torch.arange(capacity, device=self.lengths.device)[None]
        ends = self.lengths.long()[:, None]
        allowed = positions < ends
        if sliding_window is not None:
            allowed = allowed & (positions >= ends - sliding_window)
        allowed = allowed | ((ends == 0) & (positions == 0))
        return allowed[:, None, None]

    def _slots(self) -> torch.Tensor:
        capacity = self.block_table.shape[1] * self.page_size
        positions = torch.arange(capacity, device=self.block_table.device)
        blocks = self.block_table.long()[:, positions // self.page_size]
        return blocks * self.page_size + positions % self.page_size
