"""FlashAttention 2 and 4 backends (optional extras), with packed documents through varlen kernels."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

import torch

from d9d.kernels.layers._attention_mask import check_sliding_window
from d9d.kernels.layers._eager_attention import check_attention_shapes
from d9d.kernels.layers._flash_attention_4_ops import flash_attention_4, launchers_available
from d9d.kernels.layers._positions import DocumentOffsets
from d9d.kernels.layers._sdpa_attention import SdpaAttentionBackend
from d9d.kernels.layers._torch_flash_attention import flash_window

FLASH_ATTENTION_2_EXTRA = "backend-sdpa-flash-attention-2"
FLASH_ATTENTION_4_EXTRA = "backend-sdpa-flash-attention-4"
_HOPPER = 9
_SDPA_ABOVE_HEAD_DIM = 128
"""On Hopper, full causal rows with wider heads run SDPA's cuDNN kernel: at Gemma-3-1B's heads (4
query, 1 key/value, 256 wide; 4 x 4096 tokens, H100) forward and backward took 1.290 ms there
against FlashAttention 4's 1.532 ms, while FlashAttention 4 was 1.05x to 1.11x SDPA at 128."""


class AttentionBackendUnavailableError(ImportError):
    """An attention backend was asked for whose optional extra is not installed."""


def _load_functions(
    module_name: str, backend: str, extra: str
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    try:
        module = importlib.import_module(module_name)
        dense: Callable[..., Any] = module.flash_attn_func
        varlen: Callable[..., Any] = module.flash_attn_varlen_func
    except (ImportError, AttributeError) as error:
        raise AttentionBackendUnavailableError(
            f"attention backend {backend!r} needs the optional extra {extra!r}: "
            f"pip install 'd9d-kernels[{extra}]' ({error})"
        ) from error
    return dense, varlen


def _first(result: Any) -> torch.Tensor:
    """FlashAttention 4 returns ``(out, lse)``, FlashAttention 2 returns ``out``."""
    if isinstance(result, tuple):
        return cast(torch.Tensor, result[0])
    return cast(torch.Tensor, result)


class _FlashAttentionBackend:
    """Shared dense/varlen dispatch; subclasses say how a window is spelt.

    FlashAttention's ``window_size=(left, right)`` counts keys on each side of the query, so
    ``AttentionBackend``'s ``|i - j| < w`` is ``(w - 1, 0)`` when causal and ``(w - 1, w - 1)``
    when not.
    """

    _dense: Callable[..., Any]
    _varlen: Callable[..., Any]
    _document_offsets: DocumentOffsets

    def _window(self, *, causal: bool, sliding_window: int | None) -> tuple[int | None, int | None]:
        raise NotImplementedError

    def _check_supported(self, query: torch.Tensor, *, needs_grad: bool) -> None:
        """Raises before launching for what the kernels of this version cannot run; by default nothing."""

    def _attend_dense(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        softmax_scale: float,
        causal: bool,
        window: tuple[int | None, int | None],
    ) -> torch.Tensor:
        """Rows that are one sequence each; by default the package's ``flash_attn_func``."""
        return _first(
            self._dense(query, key, value, softmax_scale=softmax_scale, causal=causal, window_size=window)
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
        """See ``AttentionBackend.attend``.

        Packed documents go through the varlen kernel: every run of equal ids within a row is one
        document (documents must be contiguous, as packing makes them).
        """
        check_attention_shapes(query, key, value)
        check_sliding_window(sliding_window)
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FlashAttention needs float16 or bfloat16 inputs, got {query.dtype}")
        if not query.is_cuda:
            raise ValueError(f"FlashAttention needs CUDA tensors, got device {query.device}")
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        self._check_supported(query, needs_grad=needs_grad)
        window = self._window(causal=causal, sliding_window=sliding_window)
        if document_ids is None:
            return self._attend_dense(
                query, key, value, softmax_scale=softmax_scale, causal=causal, window=window
            )
        batch, seq, q_heads, head_dim = query.shape
        kv_heads = key.shape[2]
        cu_seqlens, max_seqlen = self._document_offsets(document_ids)
        output = _first(
            self._varlen(
                query.reshape(batch * seq, q_heads, head_dim),
                key.reshape(batch * seq, kv_heads, head_dim),
                value.reshape(batch * seq, kv_heads, head_dim),
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_seqlen,
                max_seqlen_k=max_seqlen,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window,
            )
        )
        return output.reshape(batch, seq, q_heads, head_dim)


class FlashAttention2Backend(_FlashAttentionBackend):
    """FlashAttention 2 (``flash_attn``; extra ``backend-sdpa-flash-attention-2``), Ampere and newer.

    Raises:
        AttentionBackendUnavailableError: At construction, when the extra is not installed.
    """

    def __init__(self) -> None:
        self._dense, self._varlen = _load_functions(
            "flash_attn", "flash_attention_2", FLASH_ATTENTION_2_EXTRA
        )
        self._document_offsets = DocumentOffsets()

    def _window(self, *, causal: bool, sliding_window: int | None) -> tuple[int | None, int | None]:
        if sliding_window is None:
            return (-1, -1)
        return flash_window(causal=causal, sliding_window=sliding_window)


class FlashAttention4Backend(_FlashAttentionBackend):
    """FlashAttention 4 (``flash_attn.cute``; extra ``backend-sdpa-flash-attention-4``), Hopper and Blackwell.

    Checked against ``flash-attn-4`` 4.0.0b36: ``flash_attn_func`` / ``flash_attn_varlen_func`` take
    ``softmax_scale``, ``causal`` and ``window_size=(left, right)`` (``None`` for unbounded) and
    return ``(out, lse)``; GQA needs only ``q_heads % kv_heads == 0``. On Hopper (9.x) forward and
    backward cover every mode d9d uses (causal or not, sliding window, packed documents through
    varlen) for head dims 8 to 256 in multiples of 8; Blackwell (10.x, 11.x) takes head dims up to
    128, or 256. FlashAttention 4 has no backward before Hopper, so Ampere runs it forward only.

    Raises:
        AttentionBackendUnavailableError: At construction, when the extra is not installed.
    """

    def __init__(self) -> None:
        self._dense, self._varlen = _load_functions(
            "flash_attn.cute", "flash_attention_4", FLASH_ATTENTION_4_EXTRA
        )
        self._document_offsets = DocumentOffsets()
        self._custom_ops = launchers_available()
        self._sdpa = SdpaAttentionBackend()
        # Read once here, not per call: a compiled layer would otherwise trace the device query.
        self._hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == _HOPPER

    def _attend_dense(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        softmax_scale: float,
        causal: bool,
        window: tuple[int | None, int | None],
    ) -> torch.Tensor:
        """Full causal rows with heads wider than 128 on Hopper go to SDPA (cuDNN); the rest to
        FlashAttention 4, through the custom ops where the installed version has their launchers."""
        wide_full_causal = causal and window == (None, None) and query.shape[-1] > _SDPA_ABOVE_HEAD_DIM
        if wide_full_causal and self._hopper and query.is_cuda:
            return self._sdpa.attend(query, key, value, causal=True, softmax_scale=softmax_scale)
        if self._custom_ops:
            return flash_attention_4(
                query, key, value, softmax_scale=softmax_scale, causal=causal, window=window
            )
        return super()._attend_dense(
            query, key, value, softmax_scale=softmax_scale, causal=causal, window=window
        )

    def _window(self, *, causal: bool, sliding_window: int | None) -> tuple[int | None, int | None]:
        if sliding_window is None:
            return (None, None)
        return flash_window(causal=causal, sliding_window=sliding_window)

    def _check_supported(self, query: torch.Tensor, *, needs_grad: bool) -> None:
        """Names the unsupported mode instead of an assertion deep inside the kernel launcher.

        Raises:
            NotImplementedError: For a backward before Hopper, or a head dim the GPU's kernels lack.
        """
        major, minor = torch.cuda.get_device_capability(query.device)
        head_dim = query.shape[-1]
        if needs_grad and major < 9:
            raise NotImplementedError(
                f"flash_attention_4 has no backward on compute capability {major}.{minor} (needs 9.x or "
                "newer); use flash_attention_2 or sdpa for training on this GPU"
            )
        match major:
            case 9:
                supported = 8 <= head_dim <= 256 and head_dim % 8 == 0
            case 10 | 11:
                supported = (8 <= head_dim <= 128 and head_dim % 8 == 0) or head_dim == 256
            case _:
                supported = True
        if not supported:
            raise NotImplementedError(
                f"flash_attention_4 does not support head_dim={head_dim} on compute capability "
                f"{major}.{minor}"
            )
