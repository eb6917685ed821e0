"""One Qwen3 decoder layer: pre-norm attention with q/k norms, then a dense or MoE feed-forward."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from d9d.hf.qwen3._spec import Qwen3Spec
from d9d.kernels.layers import (
    AttentionBackend,
    AttentionBackendName,
    GroupedQueryAttention,
    MoELayer,
    RMSNorm,
    SwiGLU,
)


class Qwen3DecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``; submodule names follow Hugging Face's.

    ``mlp`` is a ``SwiGLU`` on dense layers and a ``MoELayer`` (softmax top-k router, no shared
    expert) on the sparse layers of Qwen3-MoE.

    Args:
        spec: The model description.
        index: This layer's global index (selects its window and dense/sparse feed-forward).
        attention_backend: Passed to ``GroupedQueryAttention``.
    """

    def __init__(
        self,
        spec: Qwen3Spec,
        index: int,
        *,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        super().__init__()
        std = spec.initializer_range
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            head_dim=spec.head_dim,
            qk_norm=True,
            norm_eps=spec.rms_norm_eps,
            bias=spec.attention_bias,
            sliding_window=spec.sliding_windows[index],
            attention_backend=attention_backend,
            init_std=std,
        )
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp: SwiGLU | MoELayer
        if spec.moe is not None and spec.moe_layers[index]:
            moe = spec.moe
            self.mlp = MoELayer(
                spec.hidden_size,
                moe.num_experts,
                moe.top_k,
                moe.intermediate_size,
                renormalize=moe.norm_topk_prob,
                load_balancing_loss_coefficient=moe.router_aux_loss_coef or None,
                collect_load_balancing_loss=True,  # weighted like the loss: see _auxiliary_loss
                init_std=std,
            )
        else:
            self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size, init_std=std)
        self._block: Callable[..., torch.Tensor] = self._eager_block

    def reset_parameters(self) -> None:
        """Resets the norms, the attention and the feed-forward."""
        self.input_layernorm.reset_parameters()
        self.self_attn.reset_parameters()
        self.post_attention_layernorm.reset_parameters()
        self.mlp.reset_parameters()

    def compile_block(self) -> None:
        """Compiles this layer's computation with ``torch.compile`` (regional compilation).

        Only the body is compiled: hooks on the layer itself (FSDP's parameter gathering,
        activation checkpointing around it) stay outside the compiled region, and parameter
        names do not change.
        """
        self._block = torch.compile(self._eager_block)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Maps ``(batch, seq, hidden)`` to ``(batch, seq, hidden)``."""
        output: torch.Tensor = self._block(hidden_states, position_embeddings, document_ids)
        return output

    def _eager_block(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        attended = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, document_ids=document_ids
        )
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
