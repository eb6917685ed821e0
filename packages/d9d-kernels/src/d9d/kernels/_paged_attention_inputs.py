"""One paged decode attention call's tensors and options: checked once, sizes derived once.

The public op checks them; its PyTorch reference, its Triton launch and the kernels read the sizes
from here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from d9d.kernels._backend import KernelBackend
from d9d.kernels._qk_norm_rope import QKNormRope

_OP = "paged_decode_attention"


@dataclass(kw_only=True, frozen=True)
class PagedDecodeInputs:
    """The arguments of ``d9d.kernels.paged_decode_attention`` (see there for their shapes).

    Attributes:
        query: ``(rows, q_heads, head_dim)``.
        key_cache: ``(num_slots, kv_heads, head_dim)``.
        value_cache: ``(num_slots, kv_heads, value_dim)``.
        block_table: ``(rows, max_blocks)`` int32.
        lengths: ``(rows,)`` int32.
        page_size: Slots per block.
        softmax_scale: Score multiplier.
        sliding_window: The window, or None for the whole row.
        sinks: ``(q_heads,)`` attention-sink logits, or None.
        new_key: ``(rows, kv_heads, head_dim)`` keys to write at ``write_slots`` before attending,
            or None (the pool already holds them).
        new_value: ``(rows, kv_heads, value_dim)``, with ``new_key``.
        write_slots: ``(rows,)`` int64 or int32 pool slots of ``new_key`` and ``new_value``.
        row_order: ``(rows,)`` int32 permutation of the rows: the order their programs start in, or
            None (row order).
        qk_norm_rope: The per-head norms and rotation still to apply to ``query`` and ``new_key``
            (``cos`` and ``sin`` ``(rows, head_dim)``), or None (both already normalized and rotated).
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    lengths: torch.Tensor
    page_size: int
    softmax_scale: float
    sliding_window: int | None
    sinks: torch.Tensor | None
    new_key: torch.Tensor | None = None
    new_value: torch.Tensor | None = None
    write_slots: torch.Tensor | None = None
    row_order: torch.Tensor | None = None
    qk_norm_rope: QKNormRope | None = None

    @property
    def rows(self) -> int:
        """Query rows (one new token each)."""
        return self.query.shape[0]

    @property
    def q_heads(self) -> int:
        """Query heads."""
        return self.query.shape[1]

    @property
    def head_dim(self) -> int:
        """Query and key head size."""
        return self.query.shape[2]

    @property
    def kv_heads(self) -> int:
        """Key/value heads."""
        return self.key_cache.shape[1]

    @property
    def value_dim(self) -> int:
        """Value head size (the output's last dimension)."""
        return self.value_cache.shape[2]

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.q_heads // self.kv_heads

    @property
    def capacity(self) -> int:
        """Positions a row's block table addresses: ``max_blocks * page_size``."""
        return self.block_table.shape[1] * self.page_size

    @property
    def floats(self) -> tuple[torch.Tensor, ...]:
        """The floating tensors: query, caches and sinks where given."""
        prologue = self.qk_norm_rope
        return (
            (self.query, self.key_cache, self.value_cache)
            + ((self.sinks,) if self.sinks is not None else ())
            + (
                (prologue.q_weight, prologue.k_weight, prologue.cos, prologue.sin)
                if prologue is not None
                else ()
            )
        )

    @property
    def writes(self) -> bool:
        """Whether the call writes ``new_key`` and ``new_value`` into the pool first."""
        return self.write_slots is not None

    def normalized(self, backend: KernelBackend) -> PagedDecodeInputs:
        """These inputs with ``qk_norm_rope`` applied to ``query`` and ``new_key`` (by ``backend``), for
        the paths that do not fuse it into the attention; themselves without one."""
        prologue, new_key = self.qk_norm_rope, self.new_key
        if prologue is None or new_key is None:
            return self
        tables = replace(prologue, cos=prologue.cos[:, None], sin=prologue.sin[:, None])
        query, key = tables.apply(self.query[:, None], new_key[:, None], backend=backend)
        return replace(self, query=query[:, 0], new_key=key[:, 0], qk_norm_rope=None)

    def write(self) -> None:
        """``index_copy_`` of the new keys and values into the pool (the paths that do not fuse it)."""
        if self.new_key is not None and self.new_value is not None and self.write_slots is not None:
            slots = self.write_slots.to(torch.int64)
            self.key_cache.index_copy_(0, slots, self.new_key)
            self.value_cache.index_copy_(0, slots, self.new_value)

    def check(self) -> None:
        """Raises ``ValueError`` naming what does not fit (see ``paged_decode_attention``'s Raises)."""
        self._check_shapes()
        self._check_types()
        self._check_write()
        self._check_qk_norm_rope()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{_OP}: sliding_window={self.sliding_window} must be at least 1")

    def _check_shapes(self) -> None:
        query, key_cache, value_cache = self.query, self.key_cache, self.value_cache
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
            raise ValueError(
                f"{_OP}: query heads {q_heads} are not a multiple of key_cache kv_heads {kv_heads}"
            )
        page_size = self.page_size
        if page_size < 1 or num_slots % page_size != 0:
            raise ValueError(f"{_OP}: page_size={page_size} does not divide key_cache's {num_slots} slots")
        if self.block_table.dim() != 2 or self.block_table.shape[0] != rows:
            raise ValueError(
                f"{_OP}: block_table must be (rows={rows}, max_blocks), got {tuple(self.block_table.shape)}"
            )
        for name, t in (("lengths", self.lengths), ("row_order", self.row_order)):
            if t is not None and tuple(t.shape) != (rows,):
                raise ValueError(f"{_OP}: {name} must be (rows={rows},), got {tuple(t.shape)}")

    def _check_types(self) -> None:
        query, key_cache, value_cache, sinks = self.query, self.key_cache, self.value_cache, self.sinks
        if (
            not query.is_floating_point()
            or key_cache.dtype != query.dtype
            or value_cache.dtype != query.dtype
        ):
            raise ValueError(
                f"{_OP}: query, key_cache and value_cache must share one floating dtype, got {query.dtype}, "
                f"{key_cache.dtype}, {value_cache.dtype}"
            )
        indices = [("block_table", self.block_table), ("lengths", self.lengths)]
        indices += [("row_order", self.row_order)] if self.row_order is not None else []
        for name, t in indices:
            if t.dtype != torch.int32:
                raise ValueError(f"{_OP}: {name} must be int32, got {t.dtype}")
        tensors = [("key_cache", key_cache), ("value_cache", value_cache), *indices]
        tensors += [("sinks", sinks)] if sinks is not None else []
        for name, t in tensors:
            if t.device != query.device:
                raise ValueError(f"{_OP}: {name} is on {t.device}, query on {query.device}")
        if sinks is not None and (tuple(sinks.shape) != (query.shape[1],) or not sinks.is_floating_point()):
            raise ValueError(
                f"{_OP}: sinks must be a floating (q_heads={query.shape[1]},) tensor, got "
                f"{tuple(sinks.shape)} {sinks.dtype}"
            )

    def _check_write(self) -> None:
        given = [t is not None for t in (self.new_key, self.new_value, self.write_slots)]
        if not any(given):
            return
        if not all(given):
            raise ValueError(f"{_OP}: new_key, new_value and write_slots go together; got only some of them")
        new_key, new_value, slots = self.new_key, self.new_value, self.write_slots
        assert new_key is not None and new_value is not None and slots is not None
        expected = {
            "new_key": (new_key, (self.rows, self.kv_heads, self.head_dim), self.key_cache.dtype),
            "new_value": (new_value, (self.rows, self.kv_heads, self.value_dim), self.value_cache.dtype),
        }
        for name, (t, shape, dtype) in expected.items():
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{_OP}: {name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        if tuple(slots.shape) != (self.rows,) or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{_OP}: write_slots must be int32 or int64 (rows={self.rows},), got {slots.dtype} "
                f"{tuple(slots.shape)}"
            )
        for name, t in (("new_key", new_key), ("new_value", new_value), ("write_slots", slots)):
            if t.device != self.query.device:
                raise ValueError(f"{_OP}: {name} is on {t.device}, query on {self.query.device}")

    def _check_qk_norm_rope(self) -> None:
        prologue = self.qk_norm_rope
        if prologue is None:
            return
        if self.new_key is None:
            raise ValueError(
                f"{_OP}: qk_norm_rope needs new_key, new_value and write_slots (the call normalizes and "
                "rotates the new keys before it stores them)"
            )
        head_dim = self.head_dim
        if head_dim % 2 != 0:
            raise ValueError(f"{_OP}: qk_norm_rope needs an even head_dim, got {head_dim}")
        expected = {
            "qk_norm_rope.q_weight": (prologue.q_weight, (head_dim,)),
            "qk_norm_rope.k_weight": (prologue.k_weight, (head_dim,)),
            "qk_norm_rope.cos": (prologue.cos, (self.rows, head_dim)),
            "qk_norm_rope.sin": (prologue.sin, (self.rows, head_dim)),
        }
        for name, (t, shape) in expected.items():
            if tuple(t.shape) != shape or not t.is_floating_point():
                raise ValueError(
                    f"{_OP}: {name} must be a floating {shape} tensor, got {t.dtype} {tuple(t.shape)}"
                )
            if t.device != self.query.device:
                raise ValueError(f"{_OP}: {name} is on {t.device}, query on {self.query.device}")
