"""Sequential composition: the outputs of one mapper are the inputs of the next."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch

from d9d.state_mappers._errors import StateMappingError, format_names
from d9d.state_mappers._group import GroupPlan, MapperGroup, StateMapper
from d9d.state_mappers._spec import Box, TensorPiece, TensorSpec, box_union_all


class _ChainGroup(MapperGroup):
    """Groups of two consecutive steps joined through the names passing between them."""

    def __init__(self, first: Sequence[MapperGroup], second: Sequence[MapperGroup]) -> None:
        self._first = tuple(first)
        self._second = tuple(second)
        self._inputs = frozenset(n for g in self._first for n in g.inputs)
        self._outputs = frozenset(n for g in self._second for n in g.outputs)

    @property
    def inputs(self) -> frozenset[str]:
        return self._inputs

    @property
    def outputs(self) -> frozenset[str]:
        return self._outputs

    def _infer_middle(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        middle: dict[str, TensorSpec] = {}
        for group in self._first:
            middle.update(group.infer({n: input_specs[n] for n in group.inputs}))
        return middle

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        middle = self._infer_middle(input_specs)
        out: dict[str, TensorSpec] = {}
        for group in self._second:
            out.update(group.infer({n: middle[n] for n in group.inputs}))
        return out

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        middle_specs = self._infer_middle(input_specs)
        second_plans: list[GroupPlan] = []
        wanted: defaultdict[str, list[Box]] = defaultdict(list)
        for group in self._second:
            request = {o: output_boxes[o] for o in group.outputs if o in output_boxes}
            if request:
                plan = group.plan({n: middle_specs[n] for n in group.inputs}, request)
                second_plans.append(plan)
                for name, box in plan.input_boxes.items():
                    wanted[name].append(box)
        middle_boxes = {name: box_union_all(boxes) for name, boxes in wanted.items()}
        first_plans: list[GroupPlan] = []
        needed: defaultdict[str, list[Box]] = defaultdict(list)
        for group in self._first:
            request = {o: middle_boxes[o] for o in group.outputs if o in middle_boxes}
            if request:
                plan = group.plan({n: input_specs[n] for n in group.inputs}, request)
                first_plans.append(plan)
                for name, box in plan.input_boxes.items():
                    needed[name].append(box)

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            middle: dict[str, TensorPiece] = {}
            for plan in first_plans:
                for name, data in plan.run({n: pieces[n] for n in plan.input_boxes}).items():
                    middle[name] = TensorPiece(data=data, box=middle_boxes[name])
            out: dict[str, torch.Tensor] = {}
            for plan in second_plans:
                out.update(plan.run({n: middle[n] for n in plan.input_boxes}))
            return out

        return GroupPlan(input_boxes={n: box_union_all(b) for n, b in needed.items()}, run=run)


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def chain_groups(
    first: Sequence[MapperGroup], second: Sequence[MapperGroup], *, step: int
) -> list[MapperGroup]:
    """Joins two steps into groups: each connected set of groups through shared names becomes one.

    Raises:
        StateMappingError: If step ``step`` consumes names the previous steps do not produce, or
            leaves produced names unconsumed, or the previous steps produce a name twice.
    """
    producer: dict[str, int] = {}
    duplicated: set[str] = set()
    for index, group in enumerate(first):
        for name in group.outputs:
            if name in producer:
                duplicated.add(name)
            producer[name] = index
    parent = list(range(len(first)))
    unknown: set[str] = set()
    consumed: set[str] = set()
    second_root: list[int | None] = []
    for group in second:
        roots = [_find(parent, producer[n]) for n in group.inputs if n in producer]
        unknown |= {n for n in group.inputs if n not in producer}
        consumed |= group.inputs
        for root in roots[1:]:
            parent[_find(parent, root)] = _find(parent, roots[0])
        second_root.append(roots[0] if roots else None)
    problems: list[str] = []
    if duplicated:
        problems.append(
            f"steps before step {step} produce these names more than once: {format_names(duplicated)}"
        )
    if unknown:
        problems.append(
            f"step {step} consumes names the previous step does not produce: {format_names(unknown)}"
        )
    unconsumed = set(producer) - consumed
    if unconsumed:
        problems.append(
            f"step {step} does not consume these names produced by the previous step (drop them "
            f"explicitly with DropMapper): {format_names(unconsumed)}"
        )
    if problems:
        raise StateMappingError("invalid sequential mapper:\n  " + "\n  ".join(problems))
    components: dict[int, tuple[list[MapperGroup], list[MapperGroup]]] = {}
    for index, group in enumerate(first):
        components.setdefault(_find(parent, index), ([], []))[0].append(group)
    lonely: list[MapperGroup] = []
    for group, root in zip(second, second_root, strict=True):
        if root is None:
            lonely.append(group)
        else:
            components[_find(parent, root)][1].append(group)
    out: list[MapperGroup] = []
    for first_groups, second_groups in components.values():
        if len(first_groups) == 1 and not second_groups:
            out.append(first_groups[0])
        else:
            out.append(_ChainGroup(first_groups, second_groups))
    return out + lonely


class SequentialMapper:
    """Applies mappers one after another: each step consumes exactly what the previous produced.

    Groups of consecutive steps that share names are merged into one group, so for example
    "stack the experts, then transpose the stack" is one group reading the per-expert tensors.
    """

    def __init__(self, mappers: Sequence[StateMapper]) -> None:
        if not mappers:
            raise ValueError("SequentialMapper needs at least one mapper")
        self._mappers = tuple(mappers)
        self._groups: tuple[MapperGroup, ...] | None = None

    def groups(self) -> Sequence[MapperGroup]:
        if self._groups is None:
            groups = list(self._mappers[0].groups())
            for step, mapper in enumerate(self._mappers[1:], start=1):
                groups = chain_groups(groups, mapper.groups(), step=step)
            self._groups = tuple(groups)
        return self._groups
