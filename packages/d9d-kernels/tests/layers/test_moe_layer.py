"""MoE layer: balancing loss and expert bias, router variants, shared expert, the dispatcher and
grouped-GEMM slots."""

import pytest
import torch

from d9d.kernels import grouped_mm
from d9d.kernels.layers import LocalTokenDispatcher, MoELayer, TokenDispatcher, load_balancing_loss

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 32, 24, 6, 2


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


def test_grouped_matmul_slot_runs_every_expert_product() -> None:
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE)
    assert layer.experts.grouped_matmul is grouped_mm
    hidden = torch.randn(6, HIDDEN)
    expected = layer(hidden)
    seen: list[torch.Tensor] = []

    def recording(x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor, /) -> torch.Tensor:
        seen.append(weight)
        return grouped_mm(x, weight, tokens_per_group)

    layer.experts.grouped_matmul = recording
    torch.testing.assert_close(layer(hidden), expected)
    weights = (layer.experts.gate_proj, layer.experts.up_proj, layer.experts.down_proj)
    assert len(seen) == 3
    assert all(w is p for w, p in zip(seen, weights, strict=True))
    assert "grouped_matmul" not in dict(layer.named_parameters())


def test_shared_input_slot_runs_the_gate_and_up_products_in_one_call() -> None:
    torch.manual_seed(0)
    layer = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE)
    assert layer.experts.shared_input_matmul is None
    hidden = torch.randn(6, HIDDEN)
    expected = layer(hidden)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    singles: list[torch.Tensor] = []

    def pair(
        x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, tokens_per_group: torch.Tensor, /
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pairs.append((weight_a, weight_b))
        return grouped_mm(x, weight_a, tokens_per_group), grouped_mm(x, weight_b, tokens_per_group)

    def single(x: torch.Tensor, weight: torch.Tensor, tokens_per_group: torch.Tensor, /) -> torch.Tensor:
        singles.append(weight)
        return grouped_mm(x, weight, tokens_per_group)

    layer.experts.grouped_matmul = single
    layer.experts.shared_input_matmul = pair
    torch.testing.assert_close(layer(hidden), expected)
    assert len(pairs) == 1 and pairs[0][0] is layer.experts.gate_proj and pairs[0][1] is layer.experts.up_proj
    assert len(singles) == 1 and singles[0] is layer.experts.down_proj


def test_local_dispatch_groups_tokens_by_expert() -> None:
    dispatcher = LocalTokenDispatcher(3)
    hidden = torch.arange(4.0).unsqueeze(1)  # token t has value t
    indices = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]])
    weights = torch.full((4, 2), 0.5)
    tokens, per_expert = dispatcher.dispatch(hidden, indices, weights)
    torch.testing.assert_close(per_expert, torch.tensor([2, 3, 3]))
    torch.testing.assert_close(tokens.reshape(-1), torch.tensor([0.0, 2.0, 1.0, 2.0, 3.0, 0.0, 1.0, 3.0]))
    torch.testing.assert_close(dispatcher.combine(tokens), hidden)  # 0.5 * t + 0.5 * t


def test_collected_load_balancing_loss_is_handed_to_the_caller_once() -> None:
    torch.manual_seed(0)
    attached = MoELayer(HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, load_balancing_loss_coefficient=0.5)
    collected = MoELayer(
        HIDDEN,
        EXPERTS,
        TOP_K,
        INTERMEDIATE,
        load_balancing_loss_coefficient=0.5,
        collect_load_balancing_loss=True,
    )
    collected.load_state_dict(attached.state_dict())
    hidden = torch.randn(12, HIDDEN)
    attached(hidden).sum().backward()
    out = collected(hidden)
    loss = collected.pop_load_balancing_loss()
    assert loss is not None and collected.pop_load_balancing_loss() is None
    (out.sum() + loss).backward()  # the caller adds it: the same gradients as attaching it
    assert collected.router.weight.grad is not None and attached.router.weight.grad is not None
    torch.testing.assert_close(collected.router.weight.grad, attached.router.weight.grad)
    with torch.no_grad():
        collected.eval()(hidden)
    assert collected.pop_load_balancing_loss() is None  # nothing outside training


def test_token_mask_leaves_masked_tokens_out_of_the_load_balancing_statistics() -> None:
    torch.manual_seed(0)
    layer = MoELayer(
        HIDDEN,
        EXPERTS,
        TOP_K,
        INTERMEDIATE,
        load_balancing_loss_coefficient=0.5,
        collect_load_balancing_loss=True,
    )
    hidden = torch.randn(2, 5, HIDDEN)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    out = layer(hidden, mask)
    masked = layer.pop_load_balancing_statistics()
    real = layer(hidden[mask.bool()])  # only the real tokens, no mask
    alone = layer.pop_load_balancing_statistics()
    assert masked is not None and alone is not None
    torch.testing.assert_close(masked, alone)  # counts, score sums and 7 tokens
    torch.testing.assert_close(out[mask.bool()], real)  # the output does not depend on the mask
    with pytest.raises(ValueError, match=r"token_mask has shape \(10,\), the tokens \(2, 5\)"):
        layer(hidden, mask.reshape(-1))
