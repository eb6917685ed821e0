"""One Gemma 3 decoder layer: four norms, each branch normalized before and after."""

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
    from d9d.hf.gemma3._config import Gemma3TextConfig


class Gemma3DecoderLayer(DecoderLayer):
    """Gemma 3's layer: ``x + post_attn(attn(input(x)))`` then ``x + post_ff(mlp(pre_ff(x)))``.

    Every norm scales by ``1 + weight`` (RMSNorm's ``zero_centered_weight``), the per-head q/k
    norms too. Scores are scaled by ``query_pre_attn_scalar ** -0.5``; a sliding layer attends to
    the last ``sliding_window`` tokens. The gated MLP uses the tanh-approximated GELU. The core's
    ``post_attention_layernorm`` here normalizes the attention's output, as transformers names it.

    Args:
        config: The model's config.json.
        window: This layer's sliding window (None: global attention).
        attention_backend: Passed to ``GroupedQueryAttention``.
    """

    def __init__(
        self,
        config: Gemma3TextConfig,
        *,
        window: int | None,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        std, eps, width = config.initializer_range, config.rms_norm_eps, config.hidden_size
        attention = GroupedQueryAttention(
            width,
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            head_dim=config.head_dim,
            qk_norm=True,
            qk_norm_zero_centered=True,
            norm_eps=eps,
            bias=config.attention_bias,
            sliding_window=window,
            softmax_scale=config.query_pre_attn_scalar**-0.5,
            attention_backend=attention_backend,
            init_std=std,
        )
        super().__init__(
            input_layernorm=RMSNorm(width, eps, zero_centered_weight=True),
            self_attn=attention,
            post_attention_layernorm=RMSNorm(width, eps, zero_centered_weight=True),
            mlp=SwiGLU(width, config.intermediate_size, init_std=std, activation="gelu_tanh"),
        )
        self.pre_feedforward_layernorm = RMSNorm(width, eps, zero_centered_weight=True)
        self.post_feedforward_layernorm = RMSNorm(width, eps, zero_centered_weight=True)

    def reset_parameters(self) -> None:
        """Resets the core's parts and the two feed-forward norms."""
        super().reset_parameters()
        self.pre_feedforward_layernorm.reset_parameters()
        self.post_feedforward_layernorm.reset_parameters()

    def block(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        kv_cache: KeyValueCache | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Both branches normalized before and after, each added to the residual stream."""
        normed = hidden_states if self.input_layernorm is None else self.input_layernorm(hidden_states)
        attended = self.attend(normed, position_embeddings, document_ids, kv_cache)
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        fed = self.feed_forward(self.pre_feedforward_layernorm(hidden_states), token_mask)
        return hidden_states + self.post_feedforward_layernorm(fed)
