"""One OLMo 2 decoder layer: attention and the feed-forward each normalized after, not before."""

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
    from d9d.hf.olmo2._config import Olmo2Config


class Olmo2DecoderLayer(DecoderLayer):
    """OLMo 2's layer: ``x + norm(attn(x))`` then ``x + norm(mlp(x))``, no norm before either.

    The attention's q/k norms span the whole projection of all heads (``qk_norm_scope="all_heads"``),
    one weight per channel; ``post_attention_layernorm`` normalizes the attention's output and
    ``post_feedforward_layernorm`` the feed-forward's, as transformers names them.

    Args:
        config: The model's config.json.
        attention_backend: Passed to ``GroupedQueryAttention``.
    """

    def __init__(
        self,
        config: Olmo2Config,
        *,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        std = config.initializer_range
        attention = GroupedQueryAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            head_dim=config.resolved_head_dim,
            qk_norm=True,
            qk_norm_scope="all_heads",
            norm_eps=config.rms_norm_eps,
            bias=config.attention_bias,
            attention_backend=attention_backend,
            init_std=std,
        )
        super().__init__(
            input_layernorm=None,
            self_attn=attention,
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            mlp=SwiGLU(config.hidden_size, config.intermediate_size, init_std=std),
        )
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def reset_parameters(self) -> None:
        """Resets the core's parts and the post-feed-forward norm."""
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
        """``x + post_attention_layernorm(attn(x))``, then ``x + post_feedforward_layernorm(mlp(x))``."""
        attended = self.attend(hidden_states, position_embeddings, document_ids, kv_cache)
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        fed = self.feed_forward(hidden_states, token_mask)
        return hidden_states + self.post_feedforward_layernorm(fed)
