"""MoE layer against Hugging Face's Qwen3-MoE sparse block and load-balancing loss (tiny configs)."""

from typing import Any

import pytest
import torch
from torch import nn

from d9d.kernels.layers import MoELayer, load_balancing_loss

transformers = pytest.importorskip("transformers")
qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 32, 24, 6, 2


def _hf_block(norm_topk_prob: bool) -> Any:
    config = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
    )
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        nn.init.normal_(param, std=0.1)
    return block


def _copy_from_hf(ours: MoELayer, theirs: Any) -> None:
    gate_up = theirs.experts.gate_up_proj.detach()  # (E, 2I, H): gate rows first
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.experts.gate_proj.copy_(gate_up[:, :INTERMEDIATE].transpose(1, 2))
        ours.experts.up_proj.copy_(gate_up[:, INTERMEDIATE:].transpose(1, 2))
        ours.experts.down_proj.copy_(theirs.experts.down_proj.detach().transpose(1, 2))


@pytest.mark.parametrize("renormalize", [True, False])  # Qwen3-MoE's norm_topk_prob
def test_matches_qwen3_moe_sparse_block(renormalize: bool) -> None:
    torch.manual_seed(0)
    theirs = _hf_block(renormalize)
    ours = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, renormalize=renormalize)
    _copy_from_hf(ours, theirs)
    hidden = torch.randn(2, 9, HIDDEN)
    hidden_ours, hidden_theirs = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    out, expected = ours(hidden_ours), theirs(hidden_theirs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(hidden_ours.grad, hidden_theirs.grad, rtol=1e-5, atol=1e-6)
    assert ours.router.weight.grad is not None and theirs.gate.weight.grad is not None
    torch.testing.assert_close(ours.router.weight.grad, theirs.gate.weight.grad, rtol=1e-4, atol=1e-6)
    gate_up_grad = theirs.experts.gate_up_proj.grad
    assert gate_up_grad is not None and ours.experts.gate_proj.grad is not None
    torch.testing.assert_close(
        ours.experts.gate_proj.grad, gate_up_grad[:, :INTERMEDIATE].transpose(1, 2), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        ours.experts.up_proj.grad, gate_up_grad[:, INTERMEDIATE:].transpose(1, 2), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        ours.experts.down_proj.grad, theirs.experts.down_proj.grad.transpose(1, 2), rtol=1e-5, atol=1e-6
    )


def test_load_balancing_loss_matches_hugging_face() -> None:
    torch.manual_seed(0)
    logits = torch.randn(20, EXPERTS)
    scores = torch.softmax(logits, dim=-1)
    _, indices = torch.topk(scores, TOP_K, dim=-1)
    expected = qwen3_moe.load_balancing_loss_func((logits,), EXPERTS, TOP_K)
    assert isinstance(expected, torch.Tensor)
    torch.testing.assert_close(load_balancing_loss(scores, indices, EXPERTS), expected)
