"""A Qwen3 layer's feed-forward: a dense SwiGLU, or on Qwen3-MoE's sparse layers the experts."""

from __future__ import annotations

from d9d.hf.qwen3._spec import Qwen3Spec
from d9d.kernels.layers import MoELayer, SwiGLU


def qwen3_feed_forward(spec: Qwen3Spec, index: int) -> SwiGLU | MoELayer:
    """Layer ``index``'s feed-forward: the experts (softmax top-k router, no shared expert) on a
    sparse layer, else a dense SwiGLU."""
    std = spec.initializer_range
    if spec.moe is None or not spec.moe_layers[index]:
        return SwiGLU(spec.hidden_size, spec.intermediate_size, init_std=std)
    moe = spec.moe
    return MoELayer(
        spec.hidden_size,
        moe.num_experts,
        moe.top_k,
        moe.intermediate_size,
        renormalize=moe.norm_topk_prob,
        load_balancing_loss_coefficient=moe.load_balancing_coefficient or None,
        collect_load_balancing_loss=True,  # pooled over layers and weighted like the loss (d9d.hf)
        init_std=std,
    )
