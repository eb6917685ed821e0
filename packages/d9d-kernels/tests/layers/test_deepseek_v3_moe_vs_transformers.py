"""Group-limited sigmoid router and shared experts against transformers' DeepSeek-V3 MoE block."""

from typing import Any

import pytest
import torch
from torch import nn

from d9d.kernels.layers import GroupLimitedSelection, MoELayer, TopKRouter

transformers = pytest.importorskip("transformers")
deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, GROUPS, TOP_GROUPS, SHARED = 32, 16, 8, 3, 4, 2, 2


def _hf_block(norm_topk_prob: bool) -> Any:
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_group=GROUPS,
        topk_group=TOP_GROUPS,
        n_shared_experts=SHARED,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5,
    )
    block = deepseek.DeepseekV3MoE(config)
    for param in block.parameters():
        nn.init.normal_(param, std=0.1)
    with torch.no_grad():  # a correction bias large enough to change which experts win
        block.gate.e_score_correction_bias.copy_(0.3 * torch.randn(EXPERTS))
    return block


def _ours(theirs: Any, norm_topk_prob: bool) -> MoELayer:
    ours = MoELayer(
        HIDDEN,
        EXPERTS,
        TOP_K,
        INTERMEDIATE,
        shared_expert_intermediate_size=SHARED * INTERMEDIATE,
        score_function="sigmoid",
        renormalize=norm_topk_prob,
        expert_bias=True,
        router_selection=GroupLimitedSelection(num_groups=GROUPS, top_groups=TOP_GROUPS),
        routed_scaling_factor=2.5,
    )
    gate_up = theirs.experts.gate_up_proj.detach()  # (E, 2I, H): gate rows first
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        assert ours.router.expert_bias is not None
        ours.router.expert_bias.copy_(theirs.gate.e_score_correction_bias)
        ours.experts.gate_proj.copy_(gate_up[:, :INTERMEDIATE].transpose(1, 2))
        ours.experts.up_proj.copy_(gate_up[:, INTERMEDIATE:].transpose(1, 2))
        ours.experts.down_proj.copy_(theirs.experts.down_proj.detach().transpose(1, 2))
    assert ours.shared_expert is not None
    ours.shared_expert.load_state_dict(theirs.shared_experts.state_dict())
    return ours


@pytest.mark.parametrize("norm_topk_prob", [True, False])  # DeepSeek-V3's renormalization on and off
def test_matches_deepseek_v3_moe_block(norm_topk_prob: bool) -> None:
    torch.manual_seed(0)
    theirs = _hf_block(norm_topk_prob)
    ours = _ours(theirs, norm_topk_prob)
    hidden = torch.randn(2, 9, HIDDEN)
    routing = ours.router(hidden.reshape(-1, HIDDEN))
    _, hf_weights, hf_indices = theirs.gate(hidden)
    order, hf_order = routing.expert_indices.sort(-1), hf_indices.sort(-1)
    torch.testing.assert_close(order.values, hf_order.values)
    torch.testing.assert_close(
        routing.routing_weights.gather(-1, order.indices), hf_weights.gather(-1, hf_order.indices)
    )
    mine, theirs_in = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    out, expected = ours(mine), theirs(theirs_in)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(mine.grad, theirs_in.grad, rtol=1e-5, atol=1e-6)
    assert ours.router.weight.grad is not None
    torch.testing.assert_close(ours.router.weight.grad, theirs.gate.weight.grad, rtol=1e-4, atol=1e-6)
    assert ours.shared_expert is not None and ours.shared_expert.down_proj.weight.grad is not None
    torch.testing.assert_close(
        ours.shared_expert.down_proj.weight.grad,
        theirs.shared_experts.down_proj.weight.grad,
        rtol=1e-5,
        atol=1e-6,
    )


def test_group_limit_keeps_experts_of_the_best_groups_only() -> None:
    # 4 groups of 2; by their top-2 sums groups 1 and 3 are best, though expert 0 scores highest
    logits = torch.tensor([[5.0, -9.0, 2.0, 2.0, -9.0, -9.0, 1.5, 1.5]])
    assert torch.sigmoid(logits).view(4, 2).sum(-1).topk(2).indices.tolist() == [1, 3]
    selection = GroupLimitedSelection(num_groups=4, top_groups=2)
    router = TopKRouter(1, 8, 2, score_function="sigmoid", selection=selection)
    with torch.no_grad():  # a 1-wide input of 1: each expert's logit is its gate weight
        router.weight.copy_(logits.T)
    routing = router(torch.ones(1, 1))
    assert sorted(routing.expert_indices.tolist()[0]) == [2, 3]  # group 1's experts, not expert 0


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        (GroupLimitedSelection(num_groups=3, top_groups=1), "num_groups=3 must divide num_experts=8"),
        (GroupLimitedSelection(num_groups=8, top_groups=2), "groups of at least 2"),  # top-2 group score
        (GroupLimitedSelection(num_groups=4, top_groups=1), "hold at least top_k=3"),  # 2 experts < 3
        (GroupLimitedSelection(num_groups=4, top_groups=5), "top_groups=5"),
    ],
)
def test_bad_group_limits_are_refused_naming_them(selection: GroupLimitedSelection, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TopKRouter(HIDDEN, EXPERTS, TOP_K, selection=selection)


def test_routed_scaling_factor_scales_the_weights_after_renormalizing() -> None:
    torch.manual_seed(3)
    plain = TopKRouter(HIDDEN, EXPERTS, TOP_K, score_function="sigmoid")
    scaled = TopKRouter(HIDDEN, EXPERTS, TOP_K, score_function="sigmoid", routed_scaling_factor=2.5)
    scaled.load_state_dict(plain.state_dict())
    hidden = torch.randn(5, HIDDEN)
    torch.testing.assert_close(scaled(hidden).routing_weights.sum(-1), torch.full((5,), 2.5))
    torch.testing.assert_close(scaled(hidden).routing_weights, 2.5 * plain(hidden).routing_weights)
