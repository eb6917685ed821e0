"""Checking a mapper graph against source and target metadata before any tensor data is read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from d9d.state_mappers._errors import StateMappingError, format_names
from d9d.state_mappers._group import MapperGroup, StateMapper
from d9d.state_mappers._spec import TensorSpec


@dataclass(frozen=True, kw_only=True)
class ValidatedMapping:
    """A mapper graph checked against a source (and target).

    Attributes:
        groups: The mapper's groups, in order.
        input_specs: For each group, the specs of its inputs.
        output_specs: The spec of every output, across all groups.
    """

    groups: tuple[MapperGroup, ...]
    input_specs: tuple[dict[str, TensorSpec], ...]
    output_specs: dict[str, TensorSpec]


def validate_mapping(
    mapper: StateMapper,
    source: Mapping[str, TensorSpec],
    target: Mapping[str, TensorSpec] | None = None,
    *,
    strict: bool = True,
) -> ValidatedMapping:
    """Checks ``mapper`` against source (and target) specs; reads no tensor data.

    Checks: inputs missing from the source; source names no group consumes (when ``strict``);
    outputs produced twice; operations that do not fit their inputs (a stack of unequal shapes,
    say); and, given a target, outputs the target does not have, target names nothing produces,
    and shape or dtype mismatches.

    Args:
        mapper: The mapper graph.
        source: Spec of every tensor available as input.
        target: Spec of every tensor expected as output, or None when any output is welcome.
        strict: Whether a source name that no group consumes is an error.

    Returns:
        The groups with their input and output specs, ready to plan.

    Raises:
        StateMappingError: Listing every problem found, each with the offending names.
    """
    groups = tuple(mapper.groups())
    problems: list[str] = []
    consumed: set[str] = set()
    produced: set[str] = set()
    duplicated: set[str] = set()
    for group in groups:
        consumed |= group.inputs
        duplicated |= produced & group.outputs
        produced |= group.outputs
    missing_inputs = consumed - set(source)
    if missing_inputs:
        problems.append(f"missing from the source: {format_names(missing_inputs)}")
    unused = set(source) - consumed
    if strict and unused:
        problems.append(f"unexpected in the source (no mapper consumes them): {format_names(unused)}")
    if duplicated:
        problems.append(f"produced by more than one group: {format_names(duplicated)}")
    input_specs: list[dict[str, TensorSpec]] = []
    output_specs: dict[str, TensorSpec] = {}
    for group in groups:
        specs = {n: source[n] for n in group.inputs if n in source}
        input_specs.append(specs)
        if len(specs) != len(group.inputs):
            continue
        try:
            inferred = group.infer(specs)
        except (ValueError, RuntimeError, IndexError) as error:
            problems.append(_misfit(group, specs, error))
            continue
        if frozenset(inferred) != group.outputs:
            problems.append(
                f"the group producing {format_names(group.outputs)} inferred outputs {format_names(inferred)}"
            )
        output_specs.update(inferred)
    if target is not None:
        problems += _check_target(output_specs, produced, target)
    if problems:
        raise StateMappingError("state mapping does not fit:\n  " + "\n  ".join(problems))
    return ValidatedMapping(groups=groups, input_specs=tuple(input_specs), output_specs=output_specs)


def _misfit(group: MapperGroup, specs: Mapping[str, TensorSpec], error: Exception) -> str:
    names = sorted(specs)
    shown = ", ".join(f"{n!r}: {specs[n]}" for n in names[:20])
    if len(names) > 20:
        shown += f", ... and {len(names) - 20} more"
    return f"the group producing {format_names(group.outputs)} does not fit its inputs ({shown}): {error}"


def _check_target(
    output_specs: Mapping[str, TensorSpec], produced: set[str], target: Mapping[str, TensorSpec]
) -> Sequence[str]:
    problems: list[str] = []
    unexpected = produced - set(target)
    if unexpected:
        problems.append(f"unexpected outputs (the target has no such names): {format_names(unexpected)}")
    missing = set(target) - produced
    if missing:
        problems.append(f"missing for the target (no mapper produces them): {format_names(missing)}")
    mismatched = [
        f"{name!r}: mapped {output_specs[name]}, target {target[name]}"
        for name in sorted(output_specs)
        if name in target and output_specs[name] != target[name]
    ]
    if mismatched:
        problems.append("shape or dtype mismatch: " + "; ".join(mismatched))
    return problems
