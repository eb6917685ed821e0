"""One Qwen2 decoder layer: attention with q/k/v biases (none on o), then a SwiGLU feed-forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from d9d.hf._decoder import DecoderLayer
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, GroupedQueryAttention, RMSNorm, SwiGLU

if TYPE_CHECKING:
    from d9d.hf.qwen2._config import Qwen2Config


class Qwen2DecoderLayer(DecoderLayer):
    """Qwen2's layer: biases on the q/k/v projections but not on ``o_proj``, no q/k norms.

    Args:
        config: The model's config.json.
        sliding_window: This layer's attention window (None: full attention).
        attention_backend: Passed to ``GroupedQueryAttention``.
    """

    def __init__(
        self,
        config: Qwen2Config,
        sliding_window: int | None,
        *,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        std = config.initializer_range
        attention = GroupedQueryAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads or config.num_attention_heads,
            bias=True,
            sliding_window=sliding_window,
            attention_backend=attention_backend,
            init_std=std,
        )
        # GroupedQueryAttention gives all four projections a bias; Qwen2's output projection has
        # none (nn.Linear's forward and the initialization both take a None bias).
        attention.o_proj.register_parameter("bias", None)
        super().__init__(
            input_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            self_attn=attention,
            post_attention_layernorm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            mlp=SwiGLU(config.hidden_size, config.intermediate_size, init_std=std),
        )
