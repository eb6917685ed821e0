"""PyTorch scaled_dot_product_attention backend (flash / memory-efficient / cuDNN kernels inside)."""

from __future__ import annotations

import torch
from torch.nn import functional

from d9d.kernels.layers._attention_mask import build_attention_mask, needs_explicit_mask
from d9d.kernels.layers._attention_sinks import sdpa_with_sinks
from d9d.kernels.layers._eager_attention import check_attention_shapes


class SdpaAttentionBackend:
    """Attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Plain causal or full attention passes no mask, which lets PyTorch pick its flash kernel; sliding
    windows and packed documents pass a boolean ``(batch, 1, seq, seq)`` mask, which limits PyTorch
    to its memory-efficient kernel (grouped key/value heads are expanded for it, since that kernel
    takes no ``enable_gqa``). With sinks (``attend_with_sinks``) the mask is always explicit and
    carries the sink logits on one extra zero key (``sdpa_with_sinks``).
    """

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float,
        sliding_window: int | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.attend``."""
        group = check_attention_shapes(query, key, value)
        q = query.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        if needs_explicit_mask(sliding_window=sliding_window, document_ids=document_ids):
            mask = build_attention_mask(
                query.shape[1],
                causal=causal,
                sliding_window=sliding_window,
                document_ids=document_ids,
                device=query.device,
            )
            output = functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=group > 1
            )
        else:
            output = functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=group > 1
            )
        return output.transpose(1, 2)

    def attend_with_sinks(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        sinks: torch.Tensor,
        causal: bool,
        softmax_scale: float,
        sliding_window: int | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See ``SinkAttentionBackend.attend_with_sinks``."""
        check_attention_shapes(query, key, value)
        allowed = build_attention_mask(
            query.shape[1],
            causal=causal,
            sliding_window=sliding_window,
            document_ids=document_ids,
            device=query.device,
        )
        output = sdpa_with_sinks(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            allowed,
            sinks,
            softmax_scale=softmax_scale,
        )
        return output.transpose(1, 2)
