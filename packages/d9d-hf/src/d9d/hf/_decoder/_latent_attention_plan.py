"""Tensor parallelism of a multi-head latent attention layer (MLA, DeepSeek-V2/V3).

Heads split over the tp ranks as in Megatron's plan: the per-head up-projections (``q_b_proj``
or ``q_proj``, and ``kv_b_proj``) by columns, ``o_proj`` by rows. The low-rank down-projections
(``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms are small and stay whole on every rank:
their parameters become ``Replicate()`` DTensors and run on local tensors.

Why their gradients come out complete on every rank: ``ColwiseParallel`` sums the gradient of its
input over the tp ranks (its backward turns the partial sum into a replicated one), so what flows
back into the latents is whole. The rotated key part of ``kv_a_proj_with_mqa``'s output is shared
by every head, and reaches the heads without passing a column-parallel layer: each rank's gradient
there covers its own heads only, and ``LatentKeyProjectionParallel`` sums it over the tp ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Shard

from d9d.hf._decoder._decoder_layer import DecoderLayer
from d9d.hf._decoder._tensor_parallel_plan import ReplicatedParallel, feed_forward_styles, gather_sequence
from d9d.kernels.layers import MultiHeadLatentAttention


class _SumTrailingGradient(torch.autograd.Function):
    """Identity forward; backward sums the last ``width`` channels of the gradient over ``mesh``."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, width: int, mesh: DeviceMesh) -> torch.Tensor:
        ctx.width, ctx.mesh = width, mesh
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad_outputs[0]
        width: int = ctx.width
        kept = grad[..., : grad.shape[-1] - width]
        shared = grad[..., grad.shape[-1] - width :]
        partial = DTensor.from_local(shared.contiguous(), ctx.mesh, [Partial()], run_check=False)
        summed = partial.redistribute(ctx.mesh, [Replicate()]).to_local()
        return torch.cat([kept, summed], dim=-1), None, None


class LatentKeyProjectionParallel(ReplicatedParallel):
    """``kv_a_proj_with_mqa``: replicated, and the shared rotated key's gradient summed over tp ranks.

    Args:
        rope_width: The trailing output channels that are the rotated key shared by every head
            (``qk_rope_head_dim``).
    """

    def __init__(self, rope_width: int) -> None:
        super().__init__()
        self.rope_width = rope_width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        width = self.rope_width

        def sum_shared_key_gradient(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
            return _SumTrailingGradient.apply(output, width, device_mesh)

        module.register_forward_hook(sum_shared_key_gradient)
        return module


class LatentAttentionDecoderPlan:
    """MLA split by heads, dense SwiGLU feed-forwards split as in ``MegatronDecoderPlan``.

    The plan of DeepSeek-V3 (whose MoE layers are refused under tensor parallelism: they take
    expert parallelism).
    """

    def layer_styles(self, layer: DecoderLayer) -> dict[str, ParallelStyle]:
        """The styles of ``self_attn``'s projections and latent norms, the feed-forward and the norms.

        Raises:
            ValueError: If the layer's attention is not ``MultiHeadLatentAttention``.
        """
        attention = layer.self_attn
        if not isinstance(attention, MultiHeadLatentAttention):
            raise ValueError(
                "LatentAttentionDecoderPlan splits multi-head latent attention, not "
                f"{type(attention).__name__}"
            )
        styles: dict[str, ParallelStyle] = {
            # (hidden_states, position_embeddings); document_ids is a keyword argument
            "self_attn": gather_sequence(2),
            "self_attn.kv_a_proj_with_mqa": LatentKeyProjectionParallel(attention.qk_rope_head_dim),
            "self_attn.kv_a_layernorm": ReplicatedParallel(),
            "self_attn.kv_b_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        if attention.q_lora_rank is None:
            styles["self_attn.q_proj"] = ColwiseParallel()
        else:
            styles["self_attn.q_a_proj"] = ReplicatedParallel()
            styles["self_attn.q_a_layernorm"] = ReplicatedParallel()
            styles["self_attn.q_b_proj"] = ColwiseParallel()
        return styles | feed_forward_styles(layer)
