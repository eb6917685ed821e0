"""The pre-norm decoder layer every family shares: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from d9d.kernels.layers import GroupedQueryAttention, KeyValueCache, MoELayer, RMSNorm, SwiGLU


class DecoderLayer(nn.Module):
    """One decoder layer whose submodule names follow Hugging Face's.

    A family's layer subclasses this and builds the parts its config asks for (q/k norms,
    biases, a sliding window, a dense ``SwiGLU`` or a ``MoELayer``). The computation is
    ``block``, the pre-norm ``x + attn(norm(x))`` then ``x + mlp(norm(x))``: a family whose layer
    computes otherwise (OLMo 2's norms after attention and after the feed-forward, say) overrides
    ``block`` and composes ``attend`` and ``feed_forward``; the regional compilation, the
    incremental decoding and the resets stay the core's. A family that adds modules extends
    ``reset_parameters`` too.

    Args:
        input_layernorm: The norm before attention; None for a layer that attends to the
            residual stream itself (OLMo 2 normalizes after attention instead).
        self_attn: The attention.
        post_attention_layernorm: The norm before the feed-forward.
        mlp: The feed-forward.
    """

    def __init__(
        self,
        *,
        input_layernorm: RMSNorm | None,
        self_attn: GroupedQueryAttention,
        post_attention_layernorm: RMSNorm,
        mlp: SwiGLU | MoELayer,
    ) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self._block: Callable[..., torch.Tensor] = self.block

    def reset_parameters(self) -> None:
        """Resets the norms, the attention and the feed-forward."""
        if self.input_layernorm is not None:
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
        self._block = torch.compile(self.block)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        kv_cache: KeyValueCache | None = None,
        *,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Maps ``(batch, seq, hidden)`` to ``(batch, seq, hidden)``.

        With ``kv_cache`` (incremental decoding), ``hidden_states`` are the new tokens, which
        attend to the cache (eager: generation is not compiled). ``token_mask`` ``(batch, seq)``
        (nonzero on real tokens) tells a ``MoELayer`` which tokens its load-balancing
        statistics count; None counts every token.
        """
        if kv_cache is not None:
            return self.block(hidden_states, position_embeddings, document_ids, kv_cache, token_mask)
        output: torch.Tensor = self._block(hidden_states, position_embeddings, document_ids, None, token_mask)
        return output

    def attend(
        self,
        normed: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        kv_cache: KeyValueCache | None = None,
    ) -> torch.Tensor:
        """``self_attn`` of ``normed`` (no residual): a part for ``block``."""
        attended: torch.Tensor = self.self_attn(
            normed, position_embeddings, document_ids=document_ids, kv_cache=kv_cache
        )
        return attended

    def feed_forward(self, normed: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mlp`` of ``normed`` (no residual), a ``MoELayer`` told the real tokens: a part for ``block``."""
        if isinstance(self.mlp, MoELayer):
            return self.mlp(normed, token_mask)
        return self.mlp(normed)

    def block(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        kv_cache: KeyValueCache | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's computation, the extension point of a family: pre-norm attention, then
        pre-norm feed-forward, each added to the residual.

        ``forward`` calls it (compiled after ``compile_block``, eager with a ``kv_cache``). An
        override keeps this signature and computes from ``attend`` and ``feed_forward``; for
        OLMo 2's post-norms, with a ``post_feedforward_layernorm`` the family's layer adds::

            hidden_states = hidden_states + self.post_attention_layernorm(
                self.attend(hidden_states, position_embeddings, document_ids, kv_cache)
            )
            fed = self.feed_forward(hidden_states, token_mask)
            return hidden_states + self.post_feedforward_layernorm(fed)
        """
        normed = hidden_states if self.input_layernorm is None else self.input_layernorm(hidden_states)
        attended = self.attend(normed, position_embeddings, document_ids, kv_cache)
        hidden_states = hidden_states + attended
        return hidden_states + self.feed_forward(self.post_attention_layernorm(hidden_states), token_mask)
