"""Grouped-query self-attention (MHA, GQA and MQA) with a pluggable attention backend."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.kernels import QKNormRope, RopeLayout, shared_input_linear
from d9d.kernels.layers._attention_backend import AttentionBackend
from d9d.kernels.layers._attention_backend_selection import AttentionBackendName, select_attention_backend
from d9d.kernels.layers._attention_sinks import SinkAttentionBackend
from d9d.kernels.layers._init import init_linear_, init_normal_
from d9d.kernels.layers._key_value_cache import KeyValueCache, attend_cached
from d9d.kernels.layers._rms_norm import RMSNorm
from d9d.kernels.layers._rotary_applicator import RotaryApplicator


class GroupedQueryAttention(nn.Module):
    """Self-attention with ``num_heads`` query heads sharing ``num_kv_heads`` key/value heads.

    ``num_kv_heads == num_heads`` is multi-head attention, ``num_kv_heads == 1`` multi-query. The
    head counts used at forward come from the projections' local output sizes (``-1`` in a view over
    a fixed ``head_dim``), so tensor parallelism can shard ``q_proj``/``k_proj``/``v_proj`` by
    columns and ``o_proj`` by rows from outside and the layer runs on its local heads.

    Args:
        hidden_size: Model width.
        num_heads: Query heads (global).
        num_kv_heads: Key/value heads (global); must divide ``num_heads``.
        head_dim: Per-head size; ``hidden_size // num_heads`` when None.
        qk_norm: RMS-normalize queries and keys before RoPE. With ``qk_norm_scope="head"`` and a
            rotation of the whole head, both norms and both rotations are one ``qk_norm_rope`` call
            (one launch in inference on a GPU; the separate ops otherwise).
        qk_norm_scope: What one q/k norm spans: ``"head"``, every head alone with one norm of
            ``head_dim`` shared by all heads (Qwen3); ``"all_heads"``, the whole projection of all
            heads at once with a weight per channel (OLMo 2). Under column-sharded projections
            (tensor parallelism) ``"all_heads"`` would see only this rank's heads.
        norm_eps: Epsilon of the q/k norms.
        qk_norm_zero_centered: The q/k norms scale by ``1 + weight`` (RMSNorm's
            ``zero_centered_weight``; Gemma's convention).
        bias: Biases on the q/k/v/o projections.
        causal: Causal (decoder) attention.
        sliding_window: Attend only to the last ``sliding_window`` tokens (None: unlimited).
        softmax_scale: Score multiplier; ``head_dim ** -0.5`` when None.
        sinks: A learned logit per query head in every softmax denominator (attention sinks,
            GPT-OSS): the ``sinks`` parameter, ``(num_heads,)``. The backend must attend with sinks
            (``SinkAttentionBackend``: eager, SDPA; auto-detection picks SDPA); FlashAttention and
            context parallelism are refused with an error naming the backend.
        rope_layout: Layout of the cos/sin tables passed to ``forward``.
        attention_backend: A backend object, a backend name, or None for ``$D9D_ATTENTION_BACKEND``
            or auto-detection. Stored as the public ``attention_backend`` attribute, which may be
            replaced (context parallelism installs its own).
        init_std: Standard deviation of the truncated-normal projection initialization.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        head_dim: int | None = None,
        qk_norm: bool = False,
        qk_norm_scope: Literal["head", "all_heads"] = "head",
        norm_eps: float = 1e-6,
        qk_norm_zero_centered: bool = False,
        bias: bool = False,
        causal: bool = True,
        sliding_window: int | None = None,
        softmax_scale: float | None = None,
        sinks: bool = False,
        rope_layout: RopeLayout = "half",
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
            )
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
            head_dim = hidden_size // num_heads
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window={sliding_window} must be positive")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.causal = causal
        self.sliding_window = sliding_window
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
        self.init_std = init_std
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.qk_norm_scope: Literal["head", "all_heads"] = qk_norm_scope
        q_width, k_width = (
            (head_dim, head_dim)
            if qk_norm_scope == "head"
            else (num_heads * head_dim, num_kv_heads * head_dim)
        )
        centered = qk_norm_zero_centered
        self.q_norm = RMSNorm(q_width, norm_eps, zero_centered_weight=centered) if qk_norm else None
        self.k_norm = RMSNorm(k_width, norm_eps, zero_centered_weight=centered) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.rotary = RotaryApplicator(rope_layout)
        if attention_backend is None or isinstance(attention_backend, str):
            self.attention_backend: AttentionBackend = select_attention_backend(
                attention_backend, sinks=sinks
            )
        else:
            self.attention_backend = attention_backend
        if sinks:
            self._sink_backend()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Truncated-normal projections and sinks, zero biases, unit q/k norm scales."""
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            init_linear_(linear, self.init_std)
        if self.sinks is not None:
            init_normal_(self.sinks, self.init_std)
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        *,
        document_ids: torch.Tensor | None = None,
        kv_cache: KeyValueCache | None = None,
    ) -> torch.Tensor:
        """Attends every token to the allowed tokens of its row.

        Args:
            hidden_states: ``(batch, seq, hidden_size)``.
            position_embeddings: ``(cos, sin)`` from ``RotaryEmbedding``, each ``(batch, seq, rotary_dim)``.
            document_ids: ``(batch, seq)`` ids of packed documents; tokens attend only within their
                document. Pair it with per-document positions for the rotary tables.
            kv_cache: Incremental decoding: ``hidden_states`` are the new tokens only; their keys
                and values go into the cache and they attend to everything cached, under the
                cache's mask (SDPA; the attention backend is for whole sequences), or through
                the cache's own ``attend`` (an ``AttendingKeyValueCache``, e.g. a paged pool).

        Returns:
            ``(batch, seq, hidden_size)``.
        """
        batch, seq, _ = hidden_states.shape
        head_shape = (batch, seq, -1, self.head_dim)
        query, key, value = shared_input_linear(hidden_states, (self.q_proj, self.k_proj, self.v_proj))
        value = value.view(head_shape)
        cos, sin = position_embeddings
        if kv_cache is not None:
            # the norms and rotation go with the queries and keys, for a cache that applies them
            # in its attention (a paged pool's decode step: one launch fewer per layer)
            deferred = self._qk_norm_rope(cos, sin)
            if deferred is None:
                query, key = self._normalize_and_rotate(query, key, cos, sin, head_shape)
            else:
                query, key = query.view(head_shape), key.view(head_shape)
            attended = attend_cached(
                query,
                key,
                value,
                kv_cache,
                softmax_scale=self.softmax_scale,
                sliding_window=self.sliding_window,
                sinks=self.sinks,
                qk_norm_rope=deferred,
            )
            return self.o_proj(attended.reshape(batch, seq, -1))
        query, key = self._normalize_and_rotate(query, key, cos, sin, head_shape)
        if self.sinks is not None:
            attended = self._sink_backend().attend_with_sinks(
                query,
                key,
                value,
                sinks=self.sinks,
                causal=self.causal,
                softmax_scale=self.softmax_scale,
                sliding_window=self.sliding_window,
                document_ids=document_ids,
            )
            return self.o_proj(attended.reshape(batch, seq, -1))
        attended = self.attention_backend.attend(
            query,
            key,
            value,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
            sliding_window=self.sliding_window,
            document_ids=document_ids,
        )
        return self.o_proj(attended.reshape(batch, seq, -1))

    def _normalize_and_rotate(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        head_shape: tuple[int, int, int, int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k norms (if any) and RoPE of the projections, shaped ``(batch, seq, heads, head_dim)``."""
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm is None or k_norm is None:
            query, key = query.view(head_shape), key.view(head_shape)
        elif (fused := self._qk_norm_rope(cos, sin)) is not None:
            return fused.apply(query.view(head_shape), key.view(head_shape))
        else:
            if self.qk_norm_scope == "head":
                query, key = query.view(head_shape), key.view(head_shape)
            query, key = q_norm(query).view(head_shape), k_norm(key).view(head_shape)
        return self.rotary(query, cos, sin), self.rotary(key, cos, sin)

    def _qk_norm_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> QKNormRope | None:
        """The q/k norms and the rotation as one ``QKNormRope``, where ``qk_norm_rope`` takes them."""
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm is None or k_norm is None or not self._fuses_qk_norm_rope(q_norm, k_norm, cos):
            return None
        return QKNormRope(
            q_weight=q_norm.weight,
            k_weight=k_norm.weight,
            cos=cos,
            sin=sin,
            eps=q_norm.eps,
            zero_centered_weight=q_norm.zero_centered_weight,
            layout=self.rotary.layout,
        )

    def _fuses_qk_norm_rope(self, q_norm: RMSNorm, k_norm: RMSNorm, cos: torch.Tensor) -> bool:
        """Per-head norms of whole rotated heads, as plain modules: a norm whose weight is a DTensor
        (tensor parallelism's ``SequenceParallelNorm`` swaps in the local weight around its own
        forward) runs as its module."""
        return (
            self.qk_norm_scope == "head"
            and cos.shape[-1] == self.head_dim
            and q_norm.eps == k_norm.eps
            and not isinstance(q_norm.weight, DTensor)
            and not isinstance(k_norm.weight, DTensor)
        )

    def _sink_backend(self) -> SinkAttentionBackend:
        backend = self.attention_backend
        if not isinstance(backend, SinkAttentionBackend):
            raise ValueError(
                f"attention sinks need an attention backend that attends with them (eager or sdpa); "
                f"{type(backend).__name__} does not"
            )
        return backend

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"causal={self.causal}, sliding_window={self.sliding_window}, sinks={self.sinks is not None}, "
            f"backend={type(self.attention_backend).__name__}"
        )
