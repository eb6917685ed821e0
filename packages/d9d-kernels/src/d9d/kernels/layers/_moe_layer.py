"""Mixture-of-experts feed-forward layer: route, dispatch, grouped experts, combine."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.layers._auxiliary_loss import attach_auxiliary_loss
from d9d.kernels.layers._expert_activation import ExpertActivation
from d9d.kernels.layers._grouped_experts import GroupedSwiGLUExperts
from d9d.kernels.layers._load_balancing import load_balancing_statistics, pooled_load_balancing_loss
from d9d.kernels.layers._moe_router import RouterScoreFunction, RouterSelection, TopKRouter
from d9d.kernels.layers._swiglu_feed_forward import SwiGLU
from d9d.kernels.layers._token_dispatcher import LocalTokenDispatcher, TokenDispatcher


class MoELayer(nn.Module):
    """Top-k routed SwiGLU experts with an optional always-on shared expert.

    Forward: ``router`` (fp32) -> ``dispatcher.dispatch`` -> ``experts`` -> ``dispatcher.combine``
    (+ ``shared_expert``). The public attributes are the contract expert parallelism works on:
    ``num_experts``, ``top_k``, ``router`` and ``shared_expert`` (replicated), ``experts`` (every
    parameter leads with the expert dim) and ``dispatcher`` (replaceable; local by default).

    Load-balancing loss: with ``load_balancing_loss_coefficient`` set, the Switch-Transformer loss
    of every training forward is added to the backward pass (its gradient times the coefficient
    flows into the router) without changing the output, and its detached value is kept in
    ``last_load_balancing_loss`` for logging. With ``collect_load_balancing_loss=True`` the layer
    attaches nothing: ``pop_load_balancing_loss()`` hands ``coefficient * loss`` (with its graph)
    to the caller, who adds it to the objective with the weight it gives the main loss (so that
    its share does not depend on how a batch is split into microbatches); or
    ``pop_load_balancing_statistics()`` hands the routing's ``load_balancing_statistics``, for a
    loss pooled over several layers (``pooled_load_balancing_loss`` of their sum).

    Auxiliary-loss-free balancing: with ``expert_bias=True`` the layer counts tokens per expert in
    ``tokens_per_expert`` (summed over training forwards) and ``update_expert_bias(rate)`` moves the
    router's bias towards under-loaded experts and clears the counts; all-reduce the counts across
    data-parallel ranks before calling it. ``router.enable_expert_bias()`` turns it on for a layer
    built without it.

    Args:
        hidden_size: Model width.
        num_experts: Number of routed experts (global).
        top_k: Experts per token.
        intermediate_size: Hidden width of every routed expert.
        shared_expert_intermediate_size: Hidden width of the shared expert; None for none.
        score_function: Router scores, ``"softmax"`` or ``"sigmoid"``.
        renormalize: Renormalize the top-k weights to sum to one.
        expert_bias: Keep a selection bias per expert (auxiliary-loss-free balancing).
        router_selection: How the router picks experts (``TopKRouter``'s ``selection``).
        routed_scaling_factor: Multiplier of the routed weights (``TopKRouter``'s).
        load_balancing_loss_coefficient: Weight of the load-balancing loss; None disables it.
        collect_load_balancing_loss: Keep the weighted loss for ``pop_load_balancing_loss``
            instead of adding its gradient in backward.
        dispatcher: Token dispatcher; a ``LocalTokenDispatcher`` when None.
        router_bias: A learned bias on the router's logits (``TopKRouter``'s ``bias``; GPT-OSS).
        expert_projection_bias: Biases on the experts' projections (``GroupedSwiGLUExperts``'
            ``bias``; GPT-OSS).
        expert_activation: The experts' gated activation (``PlainSwiGLU()`` when None;
            ``ClampedSwiGLU`` for GPT-OSS).
        init_std: Standard deviation of the truncated-normal initialization.
    """

    tokens_per_expert: torch.Tensor

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        router_bias: bool = False,
        expert_projection_bias: bool = False,
        expert_activation: ExpertActivation | None = None,
        shared_expert_intermediate_size: int | None = None,
        score_function: RouterScoreFunction = "softmax",
        renormalize: bool = True,
        expert_bias: bool = False,
        router_selection: RouterSelection | None = None,
        routed_scaling_factor: float = 1.0,
        load_balancing_loss_coefficient: float | None = None,
        collect_load_balancing_loss: bool = False,
        dispatcher: TokenDispatcher | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.load_balancing_loss_coefficient = load_balancing_loss_coefficient
        self.collect_load_balancing_loss = collect_load_balancing_loss
        self._pending_load_balancing_statistics: torch.Tensor | None = None
        self.router = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            bias=router_bias,
            score_function=score_function,
            renormalize=renormalize,
            expert_bias=expert_bias,
            selection=router_selection,
            routed_scaling_factor=routed_scaling_factor,
            init_std=init_std,
        )
        self.experts = GroupedSwiGLUExperts(
            num_experts,
            hidden_size,
            intermediate_size,
            bias=expert_projection_bias,
            activation=expert_activation,
            init_std=init_std,
        )
        self.shared_expert = (
            SwiGLU(hidden_size, shared_expert_intermediate_size, init_std=init_std)
            if shared_expert_intermediate_size is not None
            else None
        )
        self.dispatcher: TokenDispatcher = (
            dispatcher if dispatcher is not None else LocalTokenDispatcher(num_experts)
        )
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False
        )
        self.last_load_balancing_loss: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        """Resets router, experts, shared expert and the token counts."""
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_expert is not None:
            self.shared_expert.reset_parameters()
        with torch.no_grad():
            self.tokens_per_expert.zero_()

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Maps ``(..., hidden_size)`` to ``(..., hidden_size)``.

        Args:
            hidden_states: ``(..., hidden_size)`` tokens; every one is routed and computed.
            token_mask: ``(...)``, nonzero on the tokens the load-balancing loss counts (zero
                on padding); None counts every token. The output does not depend on it.

        Raises:
            ValueError: If ``token_mask``'s shape is not ``hidden_states``' without the last dim.
        """
        shape = hidden_states.shape
        if token_mask is not None and tuple(token_mask.shape) != tuple(shape[:-1]):
            raise ValueError(
                f"MoELayer token_mask has shape {tuple(token_mask.shape)}, the tokens {tuple(shape[:-1])}"
            )
        hidden = hidden_states.reshape(-1, shape[-1])
        routing = self.router(hidden)
        if self.router.expert_bias is not None and self.training:
            with torch.no_grad():  # scatter_add rather than bincount: no host sync on the GPU
                chosen = routing.expert_indices.reshape(-1)
                self.tokens_per_expert.scatter_add_(
                    0, chosen, torch.ones_like(chosen, dtype=self.tokens_per_expert.dtype)
                )
        tokens, tokens_per_local_expert = self.dispatcher.dispatch(
            hidden, routing.expert_indices, routing.routing_weights.to(hidden.dtype)
        )
        output = self.dispatcher.combine(self.experts(tokens, tokens_per_local_expert))
        if self.shared_expert is not None:
            output = output + self.shared_expert(hidden)
        self._pending_load_balancing_statistics = None
        if self.load_balancing_loss_coefficient is not None and self.training:
            statistics = load_balancing_statistics(
                routing.scores,
                routing.expert_indices,
                self.num_experts,
                None if token_mask is None else token_mask.reshape(-1),
            )
            loss = pooled_load_balancing_loss(statistics)
            self.last_load_balancing_loss = loss.detach()
            if self.collect_load_balancing_loss:
                self._pending_load_balancing_statistics = statistics
            else:
                output = attach_auxiliary_loss(output, loss, self.load_balancing_loss_coefficient)
        return output.reshape(shape)

    def pop_load_balancing_loss(self) -> torch.Tensor | None:
        """``coefficient * loss`` of the last training forward (collect mode), then forgets it.

        None outside training, without a coefficient, or when the layer attaches the loss itself.
        """
        statistics = self.pop_load_balancing_statistics()
        if statistics is None or self.load_balancing_loss_coefficient is None:
            return None
        return self.load_balancing_loss_coefficient * pooled_load_balancing_loss(statistics)

    def pop_load_balancing_statistics(self) -> torch.Tensor | None:
        """``load_balancing_statistics`` of the last training forward (collect mode, with their graph).

        Unweighted: the caller sums them over layers and applies the coefficient to
        ``pooled_load_balancing_loss`` of the sum. None where ``pop_load_balancing_loss`` gives
        None; either call forgets them.
        """
        statistics, self._pending_load_balancing_statistics = self._pending_load_balancing_statistics, None
        return statistics

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """Moves each expert's selection bias by ``rate`` towards the mean load, then clears the counts.

        Raises:
            RuntimeError: If the layer was built without ``expert_bias``.
        """
        bias = self.router.expert_bias
        if bias is None:
            raise RuntimeError("update_expert_bias needs a MoELayer built with expert_bias=True")
        counts = self.tokens_per_expert
        bias += rate * torch.sign(counts.mean() - counts)
        counts.zero_()
