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

from dataclasses import dataclass, field

import torch

from d9d.hf import DecoderCausalLM


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

    input_ids: torch.Tensor
    positions: torch.Tensor
    new_valid: torch.Tensor
    new_flat: torch.Tensor  # the real new tokens' indices in the flattened (rows, new) positions
    write: torch.Tensor
    read: torch.Tensor
    last: torch.Tensor
    visible: torch.Tensor
    distance: torch.Tensor
    padding_sees_first: torch.Tensor
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict[int | None, torch.Tensor])

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``(rows, 1, new, total)``: causal over a row's slots, within the window; a padding
        query sees slot 0 only (so it never softmaxes over nothing)."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            allowed = self.visible
            if sliding_window is not None:
                allowed = allowed & (self.distance < sliding_window)
            mask = (allowed | self.padding_sees_first)[:, None]
            self._masks[sliding_window] = mask
        return mask


def _step_indices(batch: PagedBatch, page_size: int, pad_token_id: int, device: torch.device) -> _StepIndices:
    """Builds the step's small tables on the host, moves them once, and derives the rest on ``device``.

    Nothing here or in the layers' views reads the device back: the real new tokens are picked by
    indices built on the host (``new_flat``), not by a boolean mask (whose indexing would wait for
    the device at every layer, leaving it idle while the host launches the next kernels).
    """
    lengths = [len(row) for row in batch.tokens]
    width = max(lengths)
    new_flat = torch.tensor(
        [row * width + column for row, length in enumerate(lengths) for column in range(length)]
    ).to(device)
    total = max(start + length for start, length in zip(batch.starts, lengths, strict=True))
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.int64)
    for index, row in enumerate(batch.tokens):
        input_ids[index, : len(row)] = torch.tensor(row, dtype=torch.int64)
    table_width = max(len(blocks) for blocks in batch.blocks)
    table = torch.tensor([blocks + [0] * (table_width - len(blocks)) for blocks in batch.blocks])
    table = table.to(device)
    starts = torch.tensor(batch.starts, dtype=torch.int64).to(device)[:, None]
    counts = torch.tensor(lengths, dtype=torch.int64).to(device)[:, None]
    columns = torch.arange(width, device=device)[None]
    new_valid = columns < counts
    positions = starts + columns
    slots = torch.arange(total, device=device)[None].expand(len(lengths), total)

    def flat(logical: torch.Tensor) -> torch.Tensor:
        return table.gather(1, logical // page_size) * page_size + logical % page_size

    distance = positions[:, :, None] - slots[:, None, :]
    return _StepIndices(
        input_ids=input_ids.to(device),
        positions=positions,
        new_valid=new_valid,
        new_flat=new_flat,
        write=flat(positions.where(new_valid, 0)).flatten()[new_flat],
        read=flat(slots.where(slots < starts + counts, 0)),
        last=counts[:, 0] - 1,
        visible=distance >= 0,
        distance=distance,
        padding_sees_first=~new_valid[:, :, None] & (slots[:, None, :] == 0),
    )


@dataclass(kw_only=True, frozen=True)
class _PagedLayerView:
    """Layer ``index``'s view of the pool: d9d-kernels' ``KeyValueCache`` slot of its attention."""

    cache: PagedKVCache
    index: int
    step: _StepIndices

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatters the real new tokens into their blocks; gathers every row's slots so far."""
        keys, values = self.cache.keys[self.index], self.cache.values[self.index]
        new = self.step.new_flat
        keys.index_copy_(0, self.step.write, key.flatten(0, 1)[new].to(keys.dtype))
        values.index_copy_(0, self.step.write, value.flatten(0, 1)[new].to(values.dtype))
        return keys[self.step.read], values[self.step.read]

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        """The step's mask for the new tokens (shared by the layers with the same window)."""
        return self.step.attention_mask(sliding_window)


def forward_paged(
    model: DecoderCausalLM, cache: PagedKVCache, batch: PagedBatch, *, pad_token_id: int
) -> torch.Tensor:
    """Runs ``batch``'s new tokens through ``model``, storing their keys and values in ``cache``.

    Returns:
        ``(rows, vocab)`` float32 next-token logits at each row's last new token.
    """
    backbone = model.model
    if model.lm_head is None or backbone.norm is None:
        raise RuntimeError("generation needs the whole model (first and last pipeline stage)")
    device = cache.keys[0].device
    step = _step_indices(batch, cache.page_size, pad_token_id, device)
    hidden = backbone.embed(step.input_ids)
    tables = backbone.position_embeddings(step.positions, dtype=hidden.dtype)
    for index, (layer, position_embeddings) in enumerate(zip(backbone.decoder_layers(), tables, strict=True)):
        view = _PagedLayerView(cache=cache, index=index, step=step)
        hidden = layer(hidden, position_embeddings, None, kv_cache=view)
    last = hidden[torch.arange(hidden.shape[0], device=device), step.last][:, None]
    return model.lm_head.compute_logits(backbone.norm(last))[:, -1].float()
