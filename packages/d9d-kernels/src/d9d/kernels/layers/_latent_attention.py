"""Multi-head latent attention (MLA, DeepSeek-V2/V3): low-rank q and kv with a decoupled RoPE part."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from d9d.kernels import RopeLayout
from d9d.kernels.layers._attention_backend import AttentionBackend
from d9d.kernels.layers._attention_backend_selection import AttentionBackendName, select_attention_backend
from d9d.kernels.layers._init import init_linear_
from d9d.kernels.layers._key_value_cache import KeyValueCache, attend_cached
from d9d.kernels.layers._rms_norm import RMSNorm
from d9d.kernels.layers._rope_scaling import (
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeScaling,
    NtkRopeScaling,
    RopeScaling,
    YarnRopeScaling,
)
from d9d.kernels.layers._rotary_applicator import RotaryApplicator


def latent_attention_softmax_scale(qk_head_dim: int, rope_scaling: RopeScaling | None) -> float:
    """The score multiplier of MLA: ``qk_head_dim ** -0.5``, times ``mscale ** 2`` under YaRN.

    DeepSeek's YaRN rule: with ``mscale_all_dim`` set, ``mscale = 0.1 * mscale_all_dim *
    ln(factor) + 1`` (1 when ``factor <= 1``) scales both queries and keys, so the scores by its
    square. Other scalings (and YaRN without ``mscale_all_dim``) leave the plain scale.
    """
    scale = qk_head_dim**-0.5
    match rope_scaling:
        case YarnRopeScaling(mscale_all_dim=mscale_all_dim, factor=factor) if mscale_all_dim:
            mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            return scale * mscale * mscale
        case (
            YarnRopeScaling()
            | LinearRopeScaling()
            | NtkRopeScaling()
            | Llama3RopeScaling()
            | LongRopeScaling()
            | None
        ):
            return scale


class MultiHeadLatentAttention(nn.Module):
    """Self-attention whose keys and values come from a compressed latent shared by every head.

    Queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` without a q rank), per
    head ``qk_nope_head_dim`` plain channels then ``qk_rope_head_dim`` rotated ones. Keys and
    values: ``kv_a_proj_with_mqa(x)`` gives the latent (``kv_lora_rank``) and one rotated key
    part shared by all heads (``qk_rope_head_dim``); ``kv_b_proj(kv_a_layernorm(latent))`` gives
    each head's plain key channels and its value (``v_head_dim``). The module names are
    transformers' (``DeepseekV3Attention``).

    The attention backend takes equal key and value widths, so the narrower of
    ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim`` is zero-padded to the wider (zero
    query/key channels add nothing to a score, zero value channels are sliced off the output):
    every backend, context parallelism and the ``KeyValueCache`` slot (which holds the expanded,
    padded per-head keys and values, ``padded_head_dim`` wide) work unchanged. Head counts come
    from ``q_b_proj``/``kv_b_proj``'s local output sizes, so tensor parallelism can shard those
    by columns and ``o_proj`` by rows.

    Args:
        hidden_size: Model width.
        num_heads: Attention heads (global).
        q_lora_rank: Rank of the query compression; None for a plain ``q_proj``.
        kv_lora_rank: Rank of the key/value latent.
        qk_nope_head_dim: Per-head query/key channels without rotation.
        qk_rope_head_dim: Per-head query/key channels with rotation (the key part shared by heads).
        v_head_dim: Per-head value size.
        bias: Biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (transformers'
            ``attention_bias``; ``q_b_proj``, ``q_proj`` and ``kv_b_proj`` never have one).
        latent_norm_eps: Epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``.
        causal: Causal (decoder) attention.
        softmax_scale: Score multiplier; ``latent_attention_softmax_scale(qk_head_dim, None)``
            when None.
        rope_layout: Layout of the cos/sin tables and of the rotated channels (``"interleaved"``:
            DeepSeek-V3's ``rope_interleave``; ``"half"`` otherwise).
        attention_backend: A backend object, a name, or None for auto-detection (public
            ``attention_backend`` attribute, replaceable as in ``GroupedQueryAttention``).
        init_std: Standard deviation of the truncated-normal projection initialization.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        bias: bool = False,
        latent_norm_eps: float = 1e-6,
        causal: bool = True,
        softmax_scale: float | None = None,
        rope_layout: RopeLayout = "half",
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        for name, value in (("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):  # fmt: skip
            if value <= 0:
                raise ValueError(f"MultiHeadLatentAttention {name}={value} must be positive")
        if qk_nope_head_dim < 0 or (q_lora_rank is not None and q_lora_rank <= 0):
            raise ValueError(
                f"qk_nope_head_dim={qk_nope_head_dim} must be >= 0 and "
                f"q_lora_rank={q_lora_rank} positive or None"
            )
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.padded_head_dim = max(self.qk_head_dim, v_head_dim)
        self.causal = causal
        self.softmax_scale = self.qk_head_dim**-0.5 if softmax_scale is None else softmax_scale
        self.init_std = init_std
        q_width = num_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(hidden_size, q_width, bias=False)
            self.q_a_proj: nn.Linear | None = None
            self.q_a_layernorm: RMSNorm | None = None
            self.q_b_proj: nn.Linear | None = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, latent_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, latent_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.rotary = RotaryApplicator(rope_layout)
        if attention_backend is None or isinstance(attention_backend, str):
            self.attention_backend: AttentionBackend = select_attention_backend(attention_backend)
        else:
            self.attention_backend = attention_backend
        self.reset_parameters()

    def _linears(self) -> list[nn.Linear]:
        optional = (self.q_proj, self.q_a_proj, self.q_b_proj)
        return [m for m in optional if m is not None] + [self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj]

    def reset_parameters(self) -> None:
        """Truncated-normal projections, zero biases, unit latent norm scales."""
        for linear in self._linears():
            init_linear_(linear, self.init_std)
        if self.q_a_layernorm is not None:
            self.q_a_layernorm.reset_parameters()
        self.kv_a_layernorm.reset_parameters()

    def _queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(hidden_states)
        if self.q_a_proj is None or self.q_a_layernorm is None or self.q_b_proj is None:
            raise RuntimeError("MultiHeadLatentAttention lost its q_a_proj/q_a_layernorm/q_b_proj")
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, self.padded_head_dim - x.shape[-1]))

    def project(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys and values, each ``(batch, seq, local_heads, padded_head_dim)``."""
        batch, seq, _ = hidden_states.shape
        cos, sin = position_embeddings
        query = self._queries(hidden_states).view(batch, seq, -1, self.qk_head_dim)
        q_nope, q_rope = query[..., : self.qk_nope_head_dim], query[..., self.qk_nope_head_dim :]
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        expanded = self.kv_b_proj(self.kv_a_layernorm(latent)).view(
            batch, seq, -1, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, value = expanded.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope = self.rotary(k_rope[:, :, None], cos, sin)
        query = torch.cat([q_nope, self.rotary(q_rope, cos, sin)], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return self._pad(query), self._pad(key), self._pad(value)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        *,
        document_ids: torch.Tensor | None = None,
        kv_cache: KeyValueCache | None = None,
    ) -> torch.Tensor:
        """Attends every token to the allowed tokens of its row (``GroupedQueryAttention``'s contract).

        Args:
            hidden_states: ``(batch, seq, hidden_size)``.
            position_embeddings: ``(cos, sin)``, each ``(batch, seq, qk_rope_head_dim)``, in
                ``rope_layout``.
            document_ids: ``(batch, seq)`` ids of packed documents (attention stays inside each).
            kv_cache: Incremental decoding: the new tokens' padded keys and values go into the
                cache and they attend to everything cached (SDPA, or the cache's own ``attend``
                for an ``AttendingKeyValueCache``).

        Returns:
            ``(batch, seq, hidden_size)``.
        """
        batch, seq, _ = hidden_states.shape
        query, key, value = self.project(hidden_states, position_embeddings)
        if kv_cache is not None:
            attended = attend_cached(
                query, key, value, kv_cache, softmax_scale=self.softmax_scale, sliding_window=None
            )
        else:
            attended = self.attention_backend.attend(
                query,
                key,
                value,
                causal=self.causal,
                softmax_scale=self.softmax_scale,
                document_ids=document_ids,
            )
        return self.o_proj(attended[..., : self.v_head_dim].reshape(batch, seq, -1))

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"v_head_dim={self.v_head_dim}, backend={type(self.attention_backend).__name__}"
        )
