"""Choosing an attention backend: explicit name, then environment variable, then auto-detection."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal, get_args

import torch

from d9d.kernels.layers._attention_backend import AttentionBackend
from d9d.kernels.layers._eager_attention import EagerAttentionBackend
from d9d.kernels.layers._flash_attention import (
    AttentionBackendUnavailableError,
    FlashAttention2Backend,
    FlashAttention4Backend,
)
from d9d.kernels.layers._flex_attention import FlexAttentionBackend
from d9d.kernels.layers._sdpa_attention import SdpaAttentionBackend

AttentionBackendName = Literal["eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_4"]
ATTENTION_BACKEND_ENV_VAR = "D9D_ATTENTION_BACKEND"
_NAMES: tuple[str, ...] = get_args(AttentionBackendName)


def build_attention_backend(name: AttentionBackendName) -> AttentionBackend:
    """Builds the named backend.

    Raises:
        AttentionBackendUnavailableError: For a FlashAttention backend whose extra is missing; the
            message names the extra to install.
    """
    match name:
        case "eager":
            return EagerAttentionBackend()
        case "sdpa":
            return SdpaAttentionBackend()
        case "flex_attention":
            return FlexAttentionBackend()
        case "flash_attention_2":
            return FlashAttention2Backend()
        case "flash_attention_4":
            return FlashAttention4Backend()


def detect_attention_backend(*, sinks: bool = False) -> AttentionBackendName:
    """The fastest backend installed and supported by the current CUDA device, else ``"sdpa"``.

    FlashAttention 4 is chosen on Hopper/Blackwell (compute capability 9.x/10.x) when installed,
    FlashAttention 2 on Ampere and newer when installed; without either, Ampere and newer get
    ``"flex_attention"`` (SDPA's flash kernel for plain attention; PyTorch's FlashAttention kernels,
    else FlexAttention, for sliding windows and packed documents); everything else uses SDPA. With
    ``sinks`` only backends that attend with sinks compete: FlexAttention on Ampere and newer, else
    SDPA.
    """
    if not torch.cuda.is_available():
        return "sdpa"
    major, _ = torch.cuda.get_device_capability()
    if sinks:
        return "flex_attention" if major >= 8 else "sdpa"
    candidates: list[AttentionBackendName] = []
    if major in (9, 10):
        candidates.append("flash_attention_4")
    if major >= 8:
        candidates.append("flash_attention_2")
    for candidate in candidates:
        try:
            build_attention_backend(candidate)
        except AttentionBackendUnavailableError:
            continue
        return candidate
    return "flex_attention" if major >= 8 else "sdpa"


def _parse_name(value: str, *, source: str) -> AttentionBackendName:
    match value:
        case "eager" | "sdpa" | "flex_attention" | "flash_attention_2" | "flash_attention_4":
            return value
        case _:
            raise ValueError(f"{source}={value!r} is not an attention backend; choose one of {list(_NAMES)}")


def select_attention_backend(
    name: AttentionBackendName | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    sinks: bool = False,
) -> AttentionBackend:
    """Resolves the backend: ``name`` if given, else ``$D9D_ATTENTION_BACKEND``, else auto-detection.

    Args:
        name: Explicit choice; wins over everything.
        environ: Environment to read (``os.environ`` when None).
        sinks: The layer has attention sinks: auto-detection picks a backend that attends with
            them (an explicit choice is kept, and the layer refuses it if it cannot).

    Raises:
        ValueError: If the environment variable names no backend.
        AttentionBackendUnavailableError: If the chosen FlashAttention extra is not installed.
    """
    if name is not None:
        return build_attention_backend(_parse_name(name, source="attention_backend"))
    environment = os.environ if environ is None else environ
    configured = environment.get(ATTENTION_BACKEND_ENV_VAR, "").strip()
    if configured:
        return build_attention_backend(_parse_name(configured, source=ATTENTION_BACKEND_ENV_VAR))
    return build_attention_backend(detect_attention_backend(sinks=sinks))
