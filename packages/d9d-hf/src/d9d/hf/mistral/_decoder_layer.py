"""One Mistral decoder layer: pre-norm grouped-query attention over a window, then SwiGLU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from d9d.hf._decoder import DecoderLayer
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, GroupedQueryAttention, RMSNorm, SwiGLU

if TYPE_CHECKING:
    from d9d.hf.mistral._config import MistralConfig


class MistralDecoderLayer(DecoderLayer):
    """Mistral's layer: no biases, no q/k norms, ``sliding_window`` (when set) on every layer.

    Args:
        config: The model's config.json.
        attention_backend: Passed to ``GroupedQueryAttention``.
    """

    def __init__(
        self,
        config: MistralConfig,
        *,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        std = config.initializer_range
        attention = GroupedQueryAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            head_dim=config.resolved_head_dim,
            sliding_window=config.sliding_window,
            attention_backend=attention_backend,
            init_std=std,
        )
        super().__init__(
            input_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            self_attn=attention,
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            mlp=SwiGLU(config.hidden_size, config.intermediate_size, init_std=std),
        )
