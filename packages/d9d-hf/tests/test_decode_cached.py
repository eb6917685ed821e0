"""``DecoderBackbone.decode_cached`` (each layer's last residual add left to the next norm) equals
running the layers one by one over the same KV caches, for the "pre" layout, the "post" layout
(which adds in place) and a layer with a hook (which must still run)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from d9d.hf import DecoderCausalLM, DecoderFamily
from d9d.hf.llama import LlamaConfig
from d9d.hf.olmo2 import Olmo2Config

_SIZES: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
}


class _GrowingCache:
    """Every key and value so far, causally masked: a plain ``KeyValueCache`` for one layer."""

    def __init__(self) -> None:
        self.keys = torch.empty(0)
        self.values = torch.empty(0)
        self.new = 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.keys.numel() == 0
        self.keys = key if first else torch.cat([self.keys, key], dim=1)
        self.values = value if first else torch.cat([self.values, value], dim=1)
        self.new = key.shape[1]
        return self.keys, self.values

    def attention_mask(self, sliding_window: int | None) -> torch.Tensor:
        total = self.keys.shape[1]
        query = torch.arange(total - self.new, total)[:, None]
        key = torch.arange(total)[None, :]
        mask = key <= query
        if sliding_window is not None:
            mask &= key > query - sliding_window
        return mask[None, None].expand(self.keys.shape[0], 1, self.new, total)


def _model(family: DecoderFamily) -> DecoderCausalLM:
    torch.manual_seed(0)
    model = DecoderCausalLM(family, attention_backend="eager")
    with torch.no_grad():  # norms that are not the identity, so a skipped or doubled add shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
    return model


def _steps(model: DecoderCausalLM, *, deferred: bool) -> list[torch.Tensor]:
    """Final-norm outputs of a 5-token prompt and then 3 single tokens, through fresh caches."""
    backbone = model.model
    assert backbone.norm is not None
    caches = [_GrowingCache() for _ in backbone.decoder_layers()]
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):
            hidden = backbone.embed(ids[:, start:stop])
            positions = torch.arange(start, stop).expand(2, stop - start)
            tables = backbone.position_embeddings(positions, dtype=hidden.dtype)
            if deferred:
                outputs.append(backbone.decode_cached(hidden, tables, caches))
                continue
            for layer, table, cache in zip(backbone.decoder_layers(), tables, caches, strict=True):
                hidden = layer(hidden, table, None, kv_cache=cache)
            outputs.append(backbone.norm(hidden))
    return outputs


@pytest.mark.parametrize("layout", ["pre", "post"])
def test_decode_cached_equals_the_layers_one_by_one(layout: str) -> None:
    family: DecoderFamily = (
        LlamaConfig(model_type="llama", **_SIZES)
        if layout == "pre"
        else Olmo2Config(model_type="olmo2", **_SIZES)
    )
    model = _model(family)
    for expected, actual in zip(_steps(model, deferred=False), _steps(model, deferred=True), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_only_a_plain_pre_layer_defers_its_add() -> None:
    pre = _model(LlamaConfig(model_type="llama", **_SIZES)).model.decoder_layers()[0]
    post = _model(Olmo2Config(model_type="olmo2", **_SIZES)).model.decoder_layers()[0]
    hidden = torch.randn(2, 1, 32)
    branch = torch.randn(2, 1, 32)
    tables = (torch.ones(2, 1, 8), torch.zeros(2, 1, 8))
    with torch.no_grad():
        assert pre.decode_deferred(hidden, branch, tables, _GrowingCache())[1] is not None
        assert post.decode_deferred(hidden, branch, tables, _GrowingCache())[1] is None


def test_a_hooked_layer_runs_its_hooks_and_still_equals() -> None:
    model = _model(LlamaConfig(model_type="llama", **_SIZES))
    expected = _steps(model, deferred=False)
    calls: list[int] = []
    for layer in model.model.decoder_layers():
        layer.register_forward_pre_hook(lambda module, args: calls.append(1))
    actual = _steps(model, deferred=True)
    assert len(calls) == 4 * 3  # every step, every layer
    for want, got in zip(expected, actual, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
