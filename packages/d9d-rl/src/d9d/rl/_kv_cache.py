"""Incremental decoding of a d9d-hf decoder model (any family) with a key/value cache.

The d9d-hf layers compute attention over a whole sequence and keep nothing between calls. Here
each decoder layer's own submodules (norms, projections, q/k norms, rotary applicator, feed-forward)
run step by step, and the attention over the cached keys and values is computed with PyTorch's
SDPA, so the model classes stay unchanged and the weights are the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from d9d.hf import DecoderCausalLM, DecoderLayer


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


def _layer_forward(
    layer: DecoderLayer,
    hidden: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache,
    index: int,
) -> torch.Tensor:
    """``DecoderLayer.forward`` over new slots ``cache.filled ..``, attending to the cache."""
    attn = layer.self_attn
    batch, length, _ = hidden.shape
    start = cache.filled
    normed = layer.input_layernorm(hidden)
    head_shape = (batch, length, -1, attn.head_dim)
    query = attn.q_proj(normed).view(head_shape)
    key = attn.k_proj(normed).view(head_shape)
    value = attn.v_proj(normed).view(head_shape)
    if attn.q_norm is not None and attn.k_norm is not None:
        query = attn.q_norm(query)
        key = attn.k_norm(key)
    cos, sin = position_embeddings
    query = attn.rotary(query, cos, sin)
    key = attn.rotary(key, cos, sin)
    cache.keys[index][:, start : start + length] = key
    cache.values[index][:, start : start + length] = value
    keys = cache.keys[index][:, : start + length].transpose(1, 2)
    values = cache.values[index][:, : start + length].transpose(1, 2)
    attended = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        keys,
        values,
        attn_mask=cache.attention_mask(start, length, attn.sliding_window),
        scale=attn.softmax_scale,
        enable_gqa=True,
    )
    hidden = hidden + attn.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


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
    position_embeddings = backbone.rotary_emb(cache.positions[:, start : start + length], dtype=hidden.dtype)
    cache.new_step()
    for index, layer in enumerate(backbone.decoder_layers()):
        hidden = _layer_forward(layer, hidden, position_embeddings, cache, index)
    cache.filled = start + length
    last = backbone.norm(hidden[:, -1:])
    return model.lm_head.compute_logits(last)[:, -1].float()
