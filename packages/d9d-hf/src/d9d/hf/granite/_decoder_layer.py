"""One Granite decoder layer: Llama's parts, the scores and both residual branches scaled.

The core's ``block`` stays: it adds ``attend`` and ``feed_forward`` to the residual stream, and
this layer scales those two parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from d9d.hf._decoder import DecoderLayer
from d9d.kernels.layers import (
    AttentionBackend,
    AttentionBackendName,
    GroupedQueryAttention,
    KeyValueCache,
    RMSNorm,
    SwiGLU,
)

if TYPE_CHECKING:
    from d9d.hf.granite._config import GraniteConfig


class GraniteDecoderLayer(DecoderLayer):
    """Granite's layer: attention scores times ``attention_multiplier`` (in place of
    ``head_dim ** -0.5``), and each branch times ``residual_multiplier`` before it joins the
    residual stream. Biases on q/k/v/o with ``attention_bias``, on the MLP with ``mlp_bias``.

    Args:
        config: The model's config.json.
        attention_backend: Passed to ``GroupedQueryAttention``.
    """

    def __init__(
        self,
        config: GraniteConfig,
        *,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        std = config.initializer_range
        attention = GroupedQueryAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            bias=config.attention_bias,
            softmax_scale=config.attention_multiplier,
            attention_backend=attention_backend,
            init_std=std,
        )
        super().__init__(
            input_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            self_attn=attention,
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            mlp=SwiGLU(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, init_std=std),
        )
        self.residual_multiplier = config.residual_multiplier

    def attend(
        self,
        normed: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        kv_cache: KeyValueCache | None = None,
    ) -> torch.Tensor:
        """The attention's output times ``residual_multiplier`` (the core's ``block`` adds it)."""
        attended = super().attend(normed, position_embeddings, document_ids, kv_cache)
        return attended * self.residual_multiplier

    def feed_forward(self, normed: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output times ``residual_multiplier`` (the core's ``block`` adds it)."""
        return super().feed_forward(normed, token_mask) * self.residual_multiplier
