"""Incremental decoding of a d9d-hf decoder model (any family) with a key/value cache.

The cache owns the slots, positions and validity of every row; each decoder layer runs its own
forward on the new tokens with its attention's ``kv_cache`` slot (d9d-kernels' ``KeyValueCache``)
filled by this layer's view of the cache, so generation uses the model's code and the trainer's
weights, whatever the family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from d9d.hf import DecoderCausalLM


@dataclass(kw_only=True)
class KVCache:
    """Keys and values of every layer for ``rows`` sequences of up to ``capacity`` tokens.

    Attributes:
        keys: Per layer, ``(rows, capacity, kv_heads, head_dim)``.
        values: Same shape as ``keys``.
        valid: ``(rows, capacity)`` true on slots holding a real token (left padding and tokens
            after a row finished are false).
        positions: ``(rows, capacity)`` rotary position of each slot.
        filled: Slots written so far (the same for every row).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    positions: torch.Tensor
    filled: int = 0
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict[int | None, torch.Tensor])

    @classmethod
    def empty(cls, model: DecoderCausalLM, *, rows: int, capacity: int, device: torch.device) -> KVCache:
        """Allocates the cache for ``model``'s layers in the dtype of its weights."""
        layers = model.model.decoder_layers()
        dtype = layers[0].self_attn.k_proj.weight.dtype
        kv_heads, head_dim = model.spec.num_kv_heads, model.spec.head_dim
        shape = (rows, capacity, kv_heads, head_dim)
        return cls(
            keys=[torch.empty(shape, dtype=dtype, device=device) for _ in layers],
            values=[torch.empty(shape, dtype=dtype, device=device) for _ in layers],
            valid=torch.zeros(rows, capacity, dtype=torch.bool, device=device),
            positions=torch.zeros(rows, capacity, dtype=torch.int64, device=device),
        )

    def attention_mask(self, start: int, length: int, sliding_window: int | None) -> torch.Tensor:
        """``(rows, 1, length, start + length)`` allowed (query, key) pairs for new slots.

        Causal over slots, only valid keys, and ``|position_q - position_k| < sliding_window``;
        a query always sees itself so that padding rows never softmax over nothing.
        """
        cached = self._masks.get(sliding_window)
        if cached is not None and cached.shape[-2:] == (length, start + length):
            return cached
        end = start + length
        query_slot = torch.arange(start, end, device=self.valid.device)[:, None]
        key_slot = torch.arange(end, device=self.valid.device)[None, :]
        allowed = (key_slot <= query_slot)[None] & self.valid[:, None, :end]
        if sliding_window is not None:
            distance = self.positions[:, start:end, None] - self.positions[:, None, :end]
            allowed &= distance.abs() < sliding_window
        allowed |= (key_slot == query_slot)[None]
        mask = allowed[:, None]
        self._masks[sliding_window] = mask
        return mask

    def new_step(self) -> None:
        """Forgets the masks of the last forward (the next one covers more slots)."""
        self._masks.clear()


@dataclass(kw_only=True, frozen=True)
class _LayerSlots:
    """Layer ``index``'s view of the cache: d9d-kernels' ``KeyValueCache`` slot of its attention."""

    cache: KVCache
    index: int
    length: int

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new slots ``cache.filled ..`` and returns every slot up to them."""
        start, end = self.cache.filled, self.cache.filled + self.length
        self.cache.keys[self.index][:, start:end] = key
        self.cache.values[self.index][:, start:end] = value
        return self.cache.keys[self.index][:, :end], self.cache.values[self.index][:, :end]

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        """The cache's mask for the new slots (shared by the layers with the same window)."""
        return self.cache.attention_mask(self.cache.filled, self.length, sliding_window)


def forward_with_cache(model: DecoderCausalLM, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Runs ``input_ids`` ``(rows, length)`` at slots ``cache.filled ..``; returns the last logits.

    ``cache.valid`` and ``cache.positions`` must already describe the new slots.

    Returns:
        ``(rows, vocab)`` float32 next-token logits at the last new slot.
    """
    backbone = model.model
    if model.lm_head is None or backbone.norm is None:
        raise RuntimeError("generation needs the whole model (first and last pipeline stage)")
    start, length = cache.filled, input_ids.shape[1]
    hidden = backbone.embed(input_ids)
    tables = backbone.position_embeddings(cache.positions[:, start : start + length], dtype=hidden.dtype)
    cache.new_step()
    for index, (layer, position_embeddings) in enumerate(zip(backbone.decoder_layers(), tables, strict=True)):
        slots = _LayerSlots(cache=cache, index=index, length=length)
        hidden = layer(hidden, position_embeddings, None, kv_cache=slots)
    cache.filled = start + length
    last = backbone.norm(hidden[:, -1:])
    return model.lm_head.compute_logits(last)[:, -1].float()
