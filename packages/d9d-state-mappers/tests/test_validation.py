"""Validation before any I/O: one error listing every offending name."""

from __future__ import annotations

import pytest
import torch

from d9d.state_mappers import (
    CastMapper,
    ParallelMapper,
    RenameMapper,
    StackMapper,
    StateMappingError,
    TensorSpec,
    validate_mapping,
)

F32 = torch.float32


def _spec(*shape: int, dtype: torch.dtype = F32) -> TensorSpec:
    return TensorSpec(shape=shape, dtype=dtype)


@pytest.mark.parametrize(
    ("mapper", "source", "target", "messages"),
    [
        # an input absent from the source
        (RenameMapper("a", "x"), {"b": _spec(1)}, None, ["missing from the source: ['a']"]),
        # a source tensor nobody consumes
        (
            RenameMapper("a", "x"),
            {"a": _spec(1), "extra": _spec(1)},
            None,
            ["unexpected in the source", "'extra'"],
        ),
        # two groups writing one name
        (
            ParallelMapper([RenameMapper("a", "x"), RenameMapper("b", "x")]),
            {"a": _spec(1), "b": _spec(1)},
            None,
            ["produced by more than one group: ['x']"],
        ),
        # an output the target lacks, and a target entry nothing produces
        (
            RenameMapper("a", "x"),
            {"a": _spec(1)},
            {"y": _spec(1)},
            ["unexpected outputs", "['x']", "missing for the target", "['y']"],
        ),
        # shape mismatch against the target
        (
            RenameMapper("a", "x"),
            {"a": _spec(2, 3)},
            {"x": _spec(3, 2)},
            ["'x': mapped float32[2, 3], target float32[3, 2]"],
        ),
        # dtype mismatch against the target
        (
            CastMapper("a", torch.bfloat16),
            {"a": _spec(2)},
            {"a": _spec(2)},
            ["'a': mapped bfloat16[2], target float32[2]"],
        ),
        # an operation that does not fit its inputs
        (
            StackMapper(["a", "b"], "s"),
            {"a": _spec(1), "b": _spec(2)},
            None,
            ["does not fit its inputs", "'b'"],
        ),
    ],
)
def test_each_problem_is_reported_with_names(mapper, source, target, messages: list[str]) -> None:
    with pytest.raises(StateMappingError) as error:
        validate_mapping(mapper, source, target)
    for message in messages:
        assert message in str(error.value)


def test_all_problems_come_in_one_error() -> None:
    mapper = ParallelMapper([RenameMapper("a", "x"), RenameMapper("missing", "y"), RenameMapper("b", "x")])
    with pytest.raises(StateMappingError) as error:
        validate_mapping(
            mapper, {"a": _spec(1), "b": _spec(1), "extra": _spec(1)}, {"x": _spec(1), "z": _spec(1)}
        )
    text = str(error.value)
    for fragment in (
        "missing from the source: ['missing']",
        "(no mapper consumes them): ['extra']",
        "produced by more than one group: ['x']",
        "unexpected outputs (the target has no such names): ['y']",
        "missing for the target (no mapper produces them): ['z']",
    ):
        assert fragment in text


def test_non_strict_ignores_unconsumed_source_names() -> None:
    mapping = validate_mapping(RenameMapper("a", "x"), {"a": _spec(2), "extra": _spec(1)}, strict=False)
    assert mapping.output_specs == {"x": _spec(2)}
