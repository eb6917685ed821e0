"""Split backward: input gradients now, parameter gradients later, without computing anything twice.

The input backward (``I``) runs autograd from the stage outputs to the stage inputs. It executes
only the nodes on paths to the inputs (the *input path*), and on those nodes only the gradient
slots that lead to the inputs. Parameter gradients need what flows out of
input-path nodes into the rest of the graph; those edges form the *frontier*. ``I`` asks autograd
for the gradient on every frontier edge along with the input gradients (one engine run), and the
weight backward (``W``) seeds autograd at the frontier with them and runs to the parameters. Stage
outputs whose graph never touches an input are seeded directly in ``W``.

Every node runs once in total: input-path nodes during ``I`` (computing the frontier slots as
well), the parameter side during ``W``. So ``I`` does not retain the graph: the nodes it ran free
their saved tensors at once, and compiled regions, whose backward may donate its saved buffers and
refuses a retained graph, split like eager code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass(kw_only=True)
class WeightBackwardPlan:
    """What ``W`` starts from: gradient edges and the gradients to seed them with."""

    edges: list[GradientEdge]
    grads: list[torch.Tensor]


def _next_nodes(node: Node) -> list[tuple[Node, int]]:
    return [(n, nr) for n, nr in node.next_functions if n is not None]


def _input_path(roots: list[Node], input_nodes: set[Node]) -> set[Node]:
    """Nodes reachable from ``roots`` from which an input node is reachable (iterative DFS)."""
    leads: dict[Node, bool] = {}
    children: dict[Node, list[Node]] = {}  # read once per node: next_functions builds a new tuple
    for root in roots:
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in leads and not expanded:
                continue
            if expanded:
                leads[node] = node in input_nodes or any(leads.get(n, False) for n in children[node])
                continue
            kids = children[node] = [n for n, _ in _next_nodes(node)]
            leads.setdefault(node, False)
            stack.append((node, True))
            stack.extend((n, False) for n in kids if n not in leads)
    return {node for node, on_path in leads.items() if on_path}


def input_backward(
    targets: list[torch.Tensor], grads: list[torch.Tensor | None], inputs: list[torch.Tensor]
) -> tuple[list[torch.Tensor | None], WeightBackwardPlan]:
    """Computes the gradients of ``inputs`` and prepares the weight backward.

    Args:
        targets: Stage outputs (or the loss) that require grad.
        grads: Their gradients (None for a scalar loss).
        inputs: Stage inputs (leaves that require grad).

    Returns:
        The input gradients (None where an input is unused) and the plan for :func:`weight_backward`.
    """
    target_grads = [torch.ones_like(t) if g is None else g for t, g in zip(targets, grads, strict=True)]
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    roots = [t.grad_fn for t in targets if t.grad_fn is not None]
    on_path = _input_path(roots, input_nodes)
    frontier: list[GradientEdge] = []
    seen: set[tuple[Node, int]] = set()
    for node in on_path:
        for nxt, nr in _next_nodes(node):
            if nxt not in on_path and nxt not in input_nodes and (nxt, nr) not in seen:
                seen.add((nxt, nr))
                frontier.append(GradientEdge(nxt, nr))
    # an output that is an input itself (a stage passing a tensor through) hands its gradient over
    input_index = {id(x): i for i, x in enumerate(inputs)}
    passed = {i: input_index[id(t)] for i, t in enumerate(targets) if id(t) in input_index}
    direct = [
        i
        for i, t in enumerate(targets)
        if i not in passed and (t.grad_fn is None or t.grad_fn not in on_path)
    ]
    plan = WeightBackwardPlan(
        edges=[get_gradient_edge(targets[i]) for i in direct], grads=[target_grads[i] for i in direct]
    )
    on_path_targets = [i for i in range(len(targets)) if i not in direct and i not in passed]
    found: list[torch.Tensor | None] = [None] * len(inputs)
    if on_path_targets:
        found = _grads_and_frontier(
            [targets[i] for i in on_path_targets],
            [target_grads[i] for i in on_path_targets],
            inputs,
            frontier,
            plan,
        )
    for target, which in passed.items():
        known = found[which]
        found[which] = target_grads[target] if known is None else known + target_grads[target]
    return found, plan


def _grads_and_frontier(
    targets: list[torch.Tensor],
    grads: list[torch.Tensor],
    inputs: list[torch.Tensor],
    frontier: list[GradientEdge],
    plan: WeightBackwardPlan,
) -> list[torch.Tensor | None]:
    """One engine run for the input gradients and the frontier gradients (added to ``plan``)."""
    wanted = [*(get_gradient_edge(x) for x in inputs), *frontier]
    # W never runs a node of the input path again: nothing of what I ran is needed later.
    result = torch.autograd.grad(targets, wanted, grads, retain_graph=False, allow_unused=True)
    found: list[torch.Tensor | None] = list(result)  # allow_unused: None where nothing flows
    for edge, grad in zip(frontier, found[len(inputs) :], strict=True):
        if grad is not None:
            plan.edges.append(edge)
            plan.grads.append(grad)
    return found[: len(inputs)]


def weight_backward(plan: WeightBackwardPlan, params: list[torch.Tensor]) -> None:
    """Accumulates the parameter gradients from the plan's seeds and frees the graph."""
    if plan.edges and params:
        torch.autograd.backward(plan.edges, plan.grads, inputs=params)
