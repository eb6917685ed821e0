"""One Phi-3 decoder layer: Llama's pre-norm attention and SwiGLU, a window on every layer when set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from d9d.hf._decoder import DecoderLayer
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, GroupedQueryAttention, RMSNorm, SwiGLU

if TYPE_CHECKING:
    from d9d.hf.phi3._config import Phi3Config


class Phi3DecoderLayer(DecoderLayer):
    """Phi-3's layer, its projections held apart (the checkpoint's fused ones are split on load).

    Args:
        config: The model's config.json.
        attention_backend: Passed to ``GroupedQueryAttention``.
    """

    def __init__(
        self,
        config: Phi3Config,
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
