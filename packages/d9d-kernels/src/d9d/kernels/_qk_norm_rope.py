"""Per-head RMSNorm, then rotary embedding, of queries and keys: the public op."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d9d.kernels._backend import KernelBackend, use_triton
from d9d.kernels._rms_norm import rms_norm
from d9d.kernels._rope import RopeLayout, apply_rope, check_rotated

_OP = "qk_norm_rope"
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def qk_norm_rope(
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    zero_centered_weight: bool = False,
    layout: RopeLayout = "half",
    backend: KernelBackend = KernelBackend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope(rms_norm(query, q_weight), cos, sin)`` and the same for ``key``, in one launch.

    Qwen3-style attention normalizes every query and key head before rotating it; a decode step
    runs that as four launches per layer (two norms, two rotations) of a few kilobytes each
    (``GroupedQueryAttention`` calls this for per-head norms of whole rotated heads). Where
    Triton runs and no tensor is a subclass (DTensor), one kernel does all four over tiles of
    head rows (a head of one position is a row), the norm rounded to the output dtype before the
    rotation as the separate ops round it. Without gradients that is for eager calls (a decode
    step or a prefill; compiled, Inductor fuses the separate ops). With gradients (training, eager
    or compiled: custom ops) the backward is one persistent kernel too, which recomputes each
    head's statistics and sums both weights' gradients from per-program partials; the tables get
    no gradient (with gradients asked of them, the separate ops run). Otherwise the separate
    ``rms_norm`` and ``apply_rope`` run.

    Args:
        query: ``(batch, seq, q_heads, head_dim)``.
        key: ``(batch, seq, kv_heads, head_dim)``.
        q_weight: ``(head_dim,)``, the query norm's scale.
        k_weight: ``(head_dim,)``, the key norm's scale.
        cos: ``(batch, seq, head_dim)``, as for ``apply_rope`` (the whole head rotates).
        sin: Same shape as ``cos``.
        eps: Added to the mean square before the square root.
        zero_centered_weight: Scale by ``1 + weight`` (as ``rms_norm``).
        layout: Which elements form a rotation pair (as ``apply_rope``).
        backend: Which implementation runs (Triton on CUDA by default).

    Returns:
        The normalized and rotated ``(query, key)``, shaped and typed like the inputs.

    Raises:
        ValueError: The shapes do not fit each other (``cos`` rotating part of a head included).
    """
    _check(query, key, q_weight, k_weight, cos, sin)
    tensors = (query, key, q_weight, k_weight, cos, sin)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    plain = all(type(t) in _PLAIN for t in tensors)  # a DTensor takes the separate ops' dispatch
    interleaved = layout == "interleaved"
    if (
        plain
        and not needs_grad
        and not torch.compiler.is_compiling()
        and use_triton(backend, _OP, *tensors, fusible=True)
    ):
        from d9d.kernels._triton.qk_norm_rope_kernels import qk_norm_rope_kernel

        return qk_norm_rope_kernel(
            query, key, q_weight, k_weight, cos, sin, eps, zero_centered_weight, interleaved
        )
    if (
        plain
        and needs_grad
        and not (cos.requires_grad or sin.requires_grad)
        and use_triton(backend, _OP, *tensors)
    ):
        from d9d.kernels._triton.qk_norm_rope_op import qk_norm_rope_triton

        return qk_norm_rope_triton(
            query, key, q_weight, k_weight, cos, sin, eps, zero_centered_weight, interleaved
        )
    normed_query = rms_norm(query, q_weight, eps, zero_centered_weight=zero_centered_weight, backend=backend)
    normed_key = rms_norm(key, k_weight, eps, zero_centered_weight=zero_centered_weight, backend=backend)
    return (
        apply_rope(normed_query, cos, sin, layout=layout, backend=backend),
        apply_rope(normed_key, cos, sin, layout=layout, backend=backend),
    )


@dataclass(kw_only=True, frozen=True)
class QKNormRope:
    """``qk_norm_rope``'s weights, tables and options, for an op that applies it itself.

    ``GroupedQueryAttention`` hands this, with the unnormalized queries and keys, to a key/value
    cache that takes the norms and the rotation into its attention (``NormalizingKeyValueCache``;
    ``paged_decode_attention(qk_norm_rope=...)`` does it inside the attention kernel).

    Attributes:
        q_weight: ``(head_dim,)``, the query norm's scale.
        k_weight: ``(head_dim,)``, the key norm's scale.
        cos: The positions' cosines over the whole head: ``(batch, seq, head_dim)`` for ``apply``,
            ``(rows, head_dim)`` for ``paged_decode_attention``.
        sin: Same shape as ``cos``.
        eps: Added to the mean square before the square root.
        zero_centered_weight: Scale by ``1 + weight``.
        layout: Which elements form a rotation pair.
    """

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    eps: float
    zero_centered_weight: bool = False
    layout: RopeLayout = "half"

    def apply(
        self, query: torch.Tensor, key: torch.Tensor, *, backend: KernelBackend = KernelBackend.AUTO
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``qk_norm_rope`` of ``(batch, seq, heads, head_dim)`` queries and keys with these arguments."""
        return qk_norm_rope(
            query,
            key,
            self.q_weight,
            self.k_weight,
            self.cos,
            self.sin,
            eps=self.eps,
            zero_centered_weight=self.zero_centered_weight,
            layout=self.layout,
            backend=backend,
        )


def _check(
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    check_rotated(_OP, "query", query, cos, sin)
    if key.dim() != 4:
        raise ValueError(f"{_OP}: key must be (batch, seq, heads, head_dim), got {tuple(key.shape)}")
    batch, seq, _, head_dim = query.shape
    if (key.shape[0], key.shape[1], key.shape[3]) != (batch, seq, head_dim):
        raise ValueError(
            f"{_OP}: key {tuple(key.shape)} does not match query {tuple(query.shape)} in batch, seq, head_dim"
        )
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(t.shape) != (head_dim,):
            raise ValueError(f"{_OP}: {name} must be (head_dim={head_dim},), got {tuple(t.shape)}")
