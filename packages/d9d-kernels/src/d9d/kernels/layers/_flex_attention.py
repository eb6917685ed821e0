"""FlexAttention backend: sliding windows and attention sinks as block-sparse kernels, no dense mask."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from d9d.kernels.layers._attention_backend import AttentionBackend
from d9d.kernels.layers._attention_mask import check_document_ids, check_sliding_window
from d9d.kernels.layers._attention_sinks import check_sinks
from d9d.kernels.layers._eager_attention import check_attention_shapes
from d9d.kernels.layers._recent_tensor_memo import RecentTensorMemo
from d9d.kernels.layers._sdpa_attention import SdpaAttentionBackend
from d9d.kernels.layers._torch_flash_attention import TorchFlashAttention

_BlockMaskKey = tuple[int, bool, int | None, str]
_DocumentMaskKey = tuple[bool, int | None, str]


def _mask_mod(*, causal: bool, sliding_window: int | None) -> Callable[..., torch.Tensor]:
    """The mask of ``AttentionBackend`` (causal and/or a window), in FlexAttention's ``mask_mod`` form."""

    def allowed(
        batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> torch.Tensor:
        inside = (query - key).abs() < sliding_window if sliding_window is not None else query >= 0
        return inside & (key <= query) if causal else inside

    return allowed


def _document_block_mask(
    document_ids: torch.Tensor,
    *,
    causal: bool,
    sliding_window: int | None,
    create: Callable[..., BlockMask],
) -> BlockMask:
    """The block mask of packed rows: ``_mask_mod``'s mask, and keys of the query's own document only.

    ``create`` is ``create_block_mask``: compiled, it summarises the mask block by block; eager, it
    first builds the whole ``rows x seq x seq`` mask. The mask keeps a copy of the ids, not the
    tensor itself, so a memo of masks does not keep the caller's tensor alive (and an in-place
    change of it cannot reach a mask already built).
    """
    within = _mask_mod(causal=causal, sliding_window=sliding_window)
    ids = document_ids.clone()

    def allowed(
        batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> torch.Tensor:
        same_document = ids[batch, query] == ids[batch, key]
        return within(batch, head, query, key) & same_document

    rows, seq = document_ids.shape
    return create(allowed, rows, None, seq, seq, device=document_ids.device)


def rescale_for_sinks(output: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention without sinks turned into attention with them: each row times ``sigmoid(lse - sink)``.

    A query's weights without the sink are ``exp(score_j - lse)``; with it they are ``exp(score_j) /
    (exp(lse) + exp(sink))``, the same weights times ``exp(lse) / (exp(lse) + exp(sink))``.

    Args:
        output: ``(batch, seq, heads, head_dim)`` attention output without sinks.
        lse: ``(batch, heads, seq)`` log-sum-exp of each query's scaled, masked scores.
        sinks: ``(heads,)`` sink logits.
    """
    compute = torch.promote_types(output.dtype, torch.float32)
    kept = torch.sigmoid(lse.to(compute) - sinks.to(compute).view(1, -1, 1)).transpose(1, 2).unsqueeze(-1)
    return (output.to(compute) * kept).to(output.dtype)


class FlexAttentionBackend:
    """Windows and packed documents on PyTorch's FlashAttention kernels, else ``flex_attention``.

    Where ``TorchFlashAttention`` takes the inputs (CUDA, fp16/bf16, a torch whose ``varlen_attn``
    has ``window_size``), sliding windows and packed documents (each a varlen sequence) run there:
    at Gemma 3's shapes on an H100 a window's forward plus backward take 0.72 ms against
    FlexAttention's 1.18 ms, and packed documents skip SDPA's dense boolean mask and its
    memory-efficient kernel. Otherwise (float32, head dims the kernel's backward does not take on
    this GPU, or ``torch_flash=False``), and with sinks, FlexAttention runs them as below.

    A window of ``w`` keys over a row of ``s`` tokens touches about ``w / s`` of the score blocks;
    SDPA given the same window as a dense boolean mask computes all of them (and on a GPU falls
    back from its flash kernel). FlexAttention skips the blocks outside the window: at Gemma 3's
    shapes on an H200 (4 x 4096 tokens, 4 query heads of 256, window 512) forward plus backward
    take 1.15 ms against SDPA's 4.64 ms. Packed documents on a GPU skip, the same way, the blocks
    between documents. Everything without a window or documents (plain causal or full attention)
    goes to ``SdpaAttentionBackend``, whose flash kernel is faster there.

    With attention sinks (``attend_with_sinks``, GPT-OSS) every mask runs here, packed documents
    included: the kernel also returns each query's log-sum-exp ``lse``, and the sink joins the
    denominator afterwards as ``output * sigmoid(lse - sink)`` (the same weights as a softmax over
    the scores and the sink, with gradients through ``lse``); SDPA would need a dense float mask of
    every head with an extra key column. On a GPU the kernel is compiled (``torch.compile``; inside
    an already compiled model it is traced in place). On a CPU FlexAttention's unfused reference
    runs for inference only (it has no backward there); a CPU forward that needs gradients goes to
    SDPA, and so do packed documents without sinks on a CPU.

    The block mask of each (length, causal, window, device) is built once and reused; full
    attention (neither causal nor windowed) passes none, so FlexAttention skips the mask and its
    block-sparsity bookkeeping. Packed documents get a block mask of their rows that also keeps
    each query to keys of its own id, as SDPA's mask does; it is built once per ``document_ids``
    tensor and mask kind, since the layers share the backend and the tensor, and the masks of the
    last 8 tensors are kept (a pipeline schedule's backward recompute, or an interleaved
    gradient-accumulation microbatch, finds its mask again). On the FlashAttention
    path each run of equal ids within a row is one document (documents contiguous, as packing makes
    them), as with the FlashAttention backends.
    """

    def __init__(self, *, torch_flash: bool = True) -> None:
        """
        Args:
            torch_flash: Run sliding windows and packed documents on PyTorch's own FlashAttention
                kernels where they take the inputs (``TorchFlashAttention``); False keeps both on
                FlexAttention.
        """
        self._dense = SdpaAttentionBackend()
        self._flash = TorchFlashAttention() if torch_flash else None
        self._compiled: Callable[..., Any] = torch.compile(flex_attention)
        self._compiled_create_block_mask: Callable[..., BlockMask] = torch.compile(create_block_mask)
        self._block_masks: dict[_BlockMaskKey, BlockMask] = {}
        # built outside any compiled graph: a cache lookup, not something to trace
        self._block_mask = cast(Callable[..., BlockMask], torch.compiler.disable(self._cached_block_mask))
        self._document_masks: dict[_DocumentMaskKey, RecentTensorMemo[BlockMask]] = {}
        self._document_block_mask = cast(
            Callable[..., BlockMask], torch.compiler.disable(self._cached_document_block_mask)
        )

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
        delegate: AttentionBackend
        masked = sliding_window is not None or document_ids is not None
        if masked and self._flash is not None and self._flash.runs(query, key, value):
            check_attention_shapes(query, key, value)
            if sliding_window is not None:
                check_sliding_window(sliding_window)
            delegate = self._flash
        elif (
            not masked
            or not self._flex_runs(query, key, value)
            or (document_ids is not None and not query.is_cuda)
        ):
            delegate = self._dense
        else:
            output, _ = self._flex(
                query,
                key,
                value,
                causal=causal,
                softmax_scale=softmax_scale,
                sliding_window=sliding_window,
                document_ids=document_ids,
            )
            return output
        return delegate.attend(
            query,
            key,
            value,
            causal=causal,
            softmax_scale=softmax_scale,
            sliding_window=sliding_window,
            document_ids=document_ids,
        )

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
        if not self._flex_runs(query, key, value, sinks):
            return self._dense.attend_with_sinks(
                query,
                key,
                value,
                sinks=sinks,
                causal=causal,
                softmax_scale=softmax_scale,
                sliding_window=sliding_window,
                document_ids=document_ids,
            )
        check_sinks(sinks, query.shape[2])
        output, lse = self._flex(
            query,
            key,
            value,
            causal=causal,
            softmax_scale=softmax_scale,
            sliding_window=sliding_window,
            document_ids=document_ids,
        )
        return rescale_for_sinks(output, lse, sinks)

    def _flex(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool,
        softmax_scale: float,
        sliding_window: int | None,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FlexAttention in the ``(batch, seq, heads, head_dim)`` layout, with each query's log-sum-exp."""
        group = check_attention_shapes(query, key, value)
        if sliding_window is not None:
            check_sliding_window(sliding_window)
        block_mask: BlockMask | None
        if document_ids is not None:
            check_document_ids(document_ids, query.shape[1], query.shape[0])
            block_mask = self._document_block_mask(document_ids, causal=causal, sliding_window=sliding_window)
        elif causal or sliding_window is not None:
            block_mask = self._block_mask(
                query.shape[1], causal=causal, sliding_window=sliding_window, device=query.device
            )
        else:
            block_mask = None
        kernel = self._compiled if query.is_cuda else flex_attention
        output, aux = kernel(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            block_mask=block_mask,
            scale=softmax_scale,
            enable_gqa=group > 1,
            return_aux=AuxRequest(lse=True),
        )
        return cast(torch.Tensor, output).transpose(1, 2), cast(torch.Tensor, aux.lse)

    @staticmethod
    def _flex_runs(*tensors: torch.Tensor) -> bool:
        """FlexAttention has no backward on a CPU: there it runs only for inference."""
        return tensors[0].is_cuda or not any(t.requires_grad for t in tensors)

    def _cached_block_mask(
        self, seq: int, *, causal: bool, sliding_window: int | None, device: torch.device
    ) -> BlockMask:
        cache_key = (seq, causal, sliding_window, str(device))
        block_mask = self._block_masks.get(cache_key)
        if block_mask is None:
            mask_mod = _mask_mod(causal=causal, sliding_window=sliding_window)
            block_mask = create_block_mask(mask_mod, None, None, seq, seq, device=device)
            self._block_masks[cache_key] = block_mask
        return block_mask

    def _cached_document_block_mask(
        self, document_ids: torch.Tensor, *, causal: bool, sliding_window: int | None
    ) -> BlockMask:
        """The block mask of these packed rows, built once per recent tensor (the layers share it)."""
        cache_key = (causal, sliding_window, str(document_ids.device))
        memo = self._document_masks.get(cache_key)
        if memo is None:
            create = self._compiled_create_block_mask if document_ids.is_cuda else create_block_mask
            memo = RecentTensorMemo(
                partial(_document_block_mask, causal=causal, sliding_window=sliding_window, create=create)
            )
            self._document_masks[cache_key] = memo
        return memo(document_ids)
