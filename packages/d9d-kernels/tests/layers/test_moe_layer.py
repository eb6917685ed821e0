"""MoE layer against Hugging Face's Qwen3-MoE sparse block; routing, balancing and the dispatcher slot."""

import pytest
import torch
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func

from d9d.kernels.layers import LocalTokenDispatcher, MoELayer, TokenDispatcher, load_balancing_loss

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 32, 24, 6, 2


def _hf_block(norm_topk_prob: bool) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        nn.init.normal_(param, std=0.1)
    return block


def _copy_from_hf(ours: MoELayer, theirs: Qwen3MoeSparseMoeBlock) -> None:
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
    expected = load_balancing_loss_func((logits,), EXPERTS, TOP_K)
    assert isinstance(expected, torch.Tensor)
    torch.testing.assert_close(load_balancing_loss(scores, indices, EXPERTS), expected)


def test_load_balancing_loss_gradient_reaches_router_without_changing_output() -> None:
    torch.manual_seed(0)
    plain = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE)
    balanced = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, load_balancing_loss_coefficient=0.5)
    balanced.load_state_dict(plain.state_dict())
    hidden = torch.randn(12, HIDDEN)
    out_plain, out_balanced = plain(hidden), balanced(hidden)
    torch.testing.assert_close(out_balanced, out_plain, rtol=0, atol=0)
    out_plain.sum().backward()
    out_balanced.sum().backward()
    # The extra gradient equals that of 0.5 * loss, computed separately.
    router = plain.router
    routing = router(hidden)
    loss = load_balancing_loss(routing.scores, routing.expert_indices, EXPERTS)
    (0.5 * loss).backward()
    assert balanced.router.weight.grad is not None and router.weight.grad is not None
    torch.testing.assert_close(balanced.router.weight.grad, router.weight.grad, rtol=1e-5, atol=1e-7)
    assert balanced.last_load_balancing_loss is not None
    torch.testing.assert_close(balanced.last_load_balancing_loss, loss.detach())


def test_expert_bias_steers_selection_towards_underloaded_experts() -> None:
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, expert_bias=True)
    hidden = torch.randn(64, HIDDEN)
    with torch.no_grad():
        before = layer.router(hidden).expert_indices
        layer(hidden)
    counts = layer.tokens_per_expert.clone()
    torch.testing.assert_close(counts, torch.bincount(before.reshape(-1), minlength=EXPERTS).float())
    layer.update_expert_bias(rate=10.0)
    bias = layer.router.expert_bias
    assert bias is not None
    torch.testing.assert_close(bias, 10.0 * torch.sign(counts.mean() - counts))
    assert float(layer.tokens_per_expert.sum()) == 0.0
    # the large bias now forces selection onto the previously under-loaded experts only
    after = layer.router(hidden).expert_indices
    underloaded = set((counts < counts.mean()).nonzero().reshape(-1).tolist())
    assert set(after.reshape(-1).tolist()) <= underloaded


def test_sigmoid_router_renormalizes_weights() -> None:
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, score_function="sigmoid")
    routing = layer.router(torch.randn(5, HIDDEN))
    torch.testing.assert_close(routing.routing_weights.sum(-1), torch.ones(5))
    assert routing.routing_weights.dtype == torch.float32


def test_shared_expert_adds_its_output() -> None:
    torch.manual_seed(0)
    routed = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE)
    shared = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, shared_expert_intermediate_size=16)
    shared.load_state_dict(routed.state_dict(), strict=False)
    hidden = torch.randn(7, HIDDEN)
    assert shared.shared_expert is not None
    torch.testing.assert_close(shared(hidden), routed(hidden) + shared.shared_expert(hidden))


class _CountingDispatcher:
    """A dispatcher of our own that wraps the local one: what expert parallelism plugs in."""

    def __init__(self) -> None:
        self.inner = LocalTokenDispatcher(EXPERTS)
        self.calls = 0

    def dispatch(
        self, hidden: torch.Tensor, expert_indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.inner.dispatch(hidden, expert_indices, routing_weights)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        return self.inner.combine(expert_output)


def test_dispatcher_slot_accepts_any_conforming_object() -> None:
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE)
    hidden = torch.randn(6, HIDDEN)
    expected = layer(hidden)
    dispatcher = _CountingDispatcher()
    assert isinstance(dispatcher, TokenDispatcher)
    layer.dispatcher = dispatcher
    torch.testing.assert_close(layer(hidden), expected)
    assert dispatcher.calls == 1


def test_local_dispatch_groups_tokens_by_expert() -> None:
    dispatcher = LocalTokenDispatcher(3)
    hidden = torch.arange(4.0).unsqueeze(1)  # token t has value t
    indices = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]])
    weights = torch.full((4, 2), 0.5)
    tokens, per_expert = dispatcher.dispatch(hidden, indices, weights)
    torch.testing.assert_close(per_expert, torch.tensor([2, 3, 3]))
    torch.testing.assert_close(tokens.reshape(-1), torch.tensor([0.0, 2.0, 1.0, 2.0, 3.0, 0.0, 1.0, 3.0]))
    torch.testing.assert_close(dispatcher.combine(tokens), hidden)  # 0.5 * t + 0.5 * t
