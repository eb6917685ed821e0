"""A family whose layer computes otherwise overrides ``DecoderLayer.block``: a tiny OLMo-2-style
family (norms after attention and after the feed-forward) equals its hand-written computation."""

from __future__ import annotations

import torch

from d9d.hf import (
    DecoderCausalLM,
    DecoderFamily,
    DecoderLayer,
    LayerTensor,
    decoder_export_mapper,
    same_names,
)
from d9d.hf.llama import LlamaConfig
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, KeyValueCache, RMSNorm
from d9d.state_mappers import map_state_dict


class PostNormLayer(DecoderLayer):
    """Llama's parts, with OLMo 2's order: ``x + norm(attn(x))`` then ``x + norm(mlp(x))``."""

    def __init__(self, base: DecoderLayer, hidden_size: int, eps: float) -> None:
        super().__init__(
            input_layernorm=base.input_layernorm,
            self_attn=base.self_attn,
            post_attention_layernorm=base.post_attention_layernorm,
            mlp=base.mlp,
        )
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.post_feedforward_layernorm.reset_parameters()

    def block(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        kv_cache: KeyValueCache | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.attend(hidden_states, position_embeddings, document_ids, kv_cache)
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        return hidden_states + self.post_feedforward_layernorm(self.feed_forward(hidden_states, token_mask))


class PostNormConfig(LlamaConfig):
    """Llama's config.json with the post-norm layer and its extra norm in the name table."""

    def build_decoder_layer(
        self, index: int, *, attention_backend: AttentionBackend | AttentionBackendName | None
    ) -> DecoderLayer:
        base = super().build_decoder_layer(index, attention_backend=attention_backend)
        return PostNormLayer(base, self.hidden_size, self.rms_norm_eps)

    def layer_tensors(self, index: int) -> list[LayerTensor]:
        return [*super().layer_tensors(index), *same_names("post_feedforward_layernorm.weight")]


def _config() -> PostNormConfig:
    return PostNormConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )


def test_a_post_norm_family_equals_its_hand_written_computation() -> None:
    family: DecoderFamily = _config()
    torch.manual_seed(0)
    model = DecoderCausalLM(family, attention_backend="eager")
    for layer in model.model.decoder_layers():
        assert isinstance(layer, PostNormLayer)
        torch.nn.init.normal_(layer.post_feedforward_layernorm.weight, 1.0, 0.5)  # not the identity
    ids = torch.randint(1, 64, (2, 10))

    with torch.no_grad():
        backbone = model.model
        assert backbone.embed_tokens is not None and backbone.norm is not None
        hidden = backbone.embed_tokens(ids)
        positions = torch.arange(10).expand(2, 10)
        rotary = backbone.rotary_emb(positions, dtype=hidden.dtype)
        for layer in backbone.decoder_layers():
            assert isinstance(layer, PostNormLayer)
            hidden = hidden + layer.post_attention_layernorm(
                layer.self_attn(hidden, rotary, document_ids=None)
            )
            hidden = hidden + layer.post_feedforward_layernorm(layer.mlp(hidden))
        assert model.lm_head is not None
        expected = model.lm_head.compute_logits(backbone.norm(hidden))
        actual = model.logits(ids)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_the_extra_norm_is_exported_under_its_name() -> None:
    family: DecoderFamily = _config()
    model = DecoderCausalLM(family, attention_backend="eager")
    exported = map_state_dict(decoder_export_mapper(family, "causal_lm", model.layout), model.state_dict())
    assert "model.layers.1.post_feedforward_layernorm.weight" in exported
