"""The decoder layer every family shares: attention then a feed-forward, each added to the residual."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from d9d.hf._decoder._layer_recipe import NormLayout
from d9d.kernels.layers import (
    GroupedQueryAttention,
    KeyValueCache,
    MoELayer,
    MultiHeadLatentAttention,
    RMSNorm,
    SwiGLU,
)


class DecoderLayer(nn.Module):
    """One decoder layer whose submodule names follow Hugging Face's.

    ``build_layer`` builds it from a family's ``LayerRecipe``. The computation is ``block``:
    attention, then the feed-forward, each added to the residual stream, with the norms where
    ``norm_layout`` puts them (``NormLayout``) and each branch times ``residual_multiplier``. A
    family whose layer computes otherwise still overrides ``block`` and composes ``attend`` and
    ``feed_forward``; the regional compilation, the incremental decoding and the resets stay the
    core's. A family that adds modules extends ``reset_parameters`` too.

    Args:
        input_layernorm: The norm before attention ("pre", "sandwich"); None for a layer that
            attends to the residual stream itself ("post", or "pre" without it).
        self_attn: The attention (grouped-query, or multi-head latent for DeepSeek-V3).
        post_attention_layernorm: The norm before the feed-forward ("pre"), or of the attention's
            output ("post", "sandwich"), as transformers names it in each.
        mlp: The feed-forward.
        pre_feedforward_layernorm: The norm before the feed-forward ("sandwich" only).
        post_feedforward_layernorm: The norm of the feed-forward's output ("post", "sandwich").
        norm_layout: Where the norms sit.
        residual_multiplier: Each branch's output is multiplied by it as it joins the residual
            stream (1: unscaled).

    Raises:
        ValueError: If the norms given do not match ``norm_layout``, naming the layout and the norm.
    """

    def __init__(
        self,
        *,
        input_layernorm: RMSNorm | None,
        self_attn: GroupedQueryAttention | MultiHeadLatentAttention,
        post_attention_layernorm: RMSNorm,
        mlp: SwiGLU | MoELayer,
        pre_feedforward_layernorm: RMSNorm | None = None,
        post_feedforward_layernorm: RMSNorm | None = None,
        norm_layout: NormLayout = "pre",
        residual_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        _check_norms(norm_layout, input_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm)
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self.pre_feedforward_layernorm = pre_feedforward_layernorm
        self.post_feedforward_layernorm = post_feedforward_layernorm
        self.norm_layout: NormLayout = norm_layout
        self.residual_multiplier = residual_multiplier
        self._block: Callable[..., torch.Tensor] = self.block

    def reset_parameters(self) -> None:
        """Resets the norms, the attention and the feed-forward."""
        if self.input_layernorm is not None:
            self.input_layernorm.reset_parameters()
        self.self_attn.reset_parameters()
        self.post_attention_layernorm.reset_parameters()
        self.mlp.reset_parameters()
        for norm in (self.pre_feedforward_layernorm, self.post_feedforward_layernorm):
            if norm is not None:
                norm.reset_parameters()

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
        """The layer's computation, the extension point of a family: attention, then the
        feed-forward, each added to the residual stream, the norms where ``norm_layout`` puts them.

        ``forward`` calls it (compiled after ``compile_block``, eager with a ``kv_cache``). An
        override keeps this signature and computes from ``attend`` and ``feed_forward``.
        """
        normed = hidden_states if self.input_layernorm is None else self.input_layernorm(hidden_states)
        match self.norm_layout:
            case "pre":
                stream, branch = self._attend_and_feed(
                    hidden_states, normed, position_embeddings, document_ids, kv_cache, token_mask
                )
                return stream + branch
            case "post" | "sandwich":
                attended = self.attend(normed, position_embeddings, document_ids, kv_cache)
                hidden_states, normed = self.post_attention_layernorm.normalize_and_add(
                    hidden_states,
                    attended,
                    scale=self.residual_multiplier,
                    then=self.pre_feedforward_layernorm,
                )
                fed = self.feed_forward(normed, token_mask)
                after = self.post_feedforward_layernorm
                if after is None:  # _check_norms: never in these layouts; the type checker cannot tell
                    raise RuntimeError(
                        f"norm_layout={self.norm_layout!r} without a post_feedforward_layernorm"
                    )
                output, _ = after.normalize_and_add(hidden_states, fed, scale=self.residual_multiplier)
                return output

    def decode_deferred(
        self,
        stream: torch.Tensor,
        branch: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KeyValueCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This layer over ``kv_cache`` with the residual adds at its ends left to the norms beside them.

        The input is ``stream + branch`` (``stream`` alone when ``branch`` is None) and so is the
        output ``(stream, branch)``. In the "pre" layout the input norm adds the incoming branch
        in its own kernel (``RMSNorm.add_and_normalize``) and the feed-forward's output comes back
        unadded, for the next layer's input norm or the final norm to add: a decode step saves a
        launch per layer. Another layout, a family's own ``block`` or hooks on this layer (FSDP's)
        add the branch first, run the layer as ``forward`` does and return no branch.
        """
        norm = self.input_layernorm
        plain = type(self).block is DecoderLayer.block and not (
            self._forward_hooks or self._forward_pre_hooks
        )
        if norm is None or self.norm_layout != "pre" or not plain:
            hidden = stream if branch is None else stream + branch
            output: torch.Tensor = self(hidden, position_embeddings, None, kv_cache)
            return output, None
        if branch is None:
            normed = norm(stream)
        else:
            stream, normed = norm.add_and_normalize(stream, branch)
        return self._attend_and_feed(stream, normed, position_embeddings, None, kv_cache, None)

    def _attend_and_feed(
        self,
        stream: torch.Tensor,
        normed: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        document_ids: torch.Tensor | None,
        kv_cache: KeyValueCache | None,
        token_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The "pre" layout after the input norm: the stream with the attention added, and the
        feed-forward's scaled output still to add to it."""
        attended = self.attend(normed, position_embeddings, document_ids, kv_cache)
        stream, normed = self.post_attention_layernorm.add_and_normalize(stream, self._scaled(attended))
        return stream, self._scaled(self.feed_forward(normed, token_mask))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """``branch`` times ``residual_multiplier`` (unchanged at 1)."""
        return branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier


def _check_norms(
    layout: NormLayout,
    input_layernorm: RMSNorm | None,
    pre_feedforward_layernorm: RMSNorm | None,
    post_feedforward_layernorm: RMSNorm | None,
) -> None:
    """Raises a ``ValueError`` naming ``layout`` and the norm it lacks or does not take."""
    match layout:
        case "pre":
            wanted = {"pre_feedforward_layernorm": False, "post_feedforward_layernorm": False}
        case "post":
            wanted = {
                "input_layernorm": False,
                "pre_feedforward_layernorm": False,
                "post_feedforward_layernorm": True,
            }
        case "sandwich":
            wanted = {
                "input_layernorm": True,
                "pre_feedforward_layernorm": True,
                "post_feedforward_layernorm": True,
            }
    given = {
        "input_layernorm": input_layernorm is not None,
        "pre_feedforward_layernorm": pre_feedforward_layernorm is not None,
        "post_feedforward_layernorm": post_feedforward_layernorm is not None,
    }
    for name, needed in wanted.items():
        if given[name] != needed:
            verb = "needs" if needed else "takes no"
            raise ValueError(f"DecoderLayer(norm_layout={layout!r}) {verb} {name}")
