"""Composition: sequential merges groups through shared names, parallel, prefix scope, filter."""

from __future__ import annotations

import pytest
import torch

from d9d.state_mappers import (
    ChunkMapper,
    DropMapper,
    FilterMapper,
    IdentityMapper,
    ParallelMapper,
    PrefixMapper,
    RenameMapper,
    SelectMapper,
    SequentialMapper,
    StackMapper,
    StateMappingError,
    TensorPiece,
    TensorSpec,
    TransposeMapper,
    identity_mapper_from_module,
    map_state_dict,
)


def test_sequential_merges_groups_linked_by_names() -> None:
    # stack(e0, e1) -> transpose is one group; rename of "n" stays a group of its own.
    mapper = SequentialMapper(
        [
            ParallelMapper([StackMapper(["e0", "e1"], "s"), IdentityMapper("n")]),
            ParallelMapper(
                [TransposeMapper("s", dim0=1, dim1=2, ndim=3, target="out"), RenameMapper("n", "m")]
            ),
        ]
    )
    groups = mapper.groups()
    assert sorted((sorted(g.inputs), sorted(g.outputs)) for g in groups) == [
        (["e0", "e1"], ["out"]),
        (["n"], ["m"]),
    ]
    state = {"e0": torch.randn(2, 3), "e1": torch.randn(2, 3), "n": torch.randn(1)}
    out = map_state_dict(mapper, state)
    assert torch.equal(out["out"], torch.stack([state["e0"], state["e1"]]).transpose(1, 2))
    assert torch.equal(out["m"], state["n"])


def test_sequential_slice_plan_reads_only_needed_experts() -> None:
    # Expert 1 of transpose(stack(e0..e3)) reads only e1.
    mapper = SequentialMapper(
        [
            StackMapper([f"e{i}" for i in range(4)], "s"),
            TransposeMapper("s", dim0=1, dim1=2, ndim=3, target="out"),
        ]
    )
    (group,) = mapper.groups()
    specs = {f"e{i}": TensorSpec(shape=(2, 3), dtype=torch.float32) for i in range(4)}
    plan = group.plan(specs, {"out": ((1, 2), (0, 3), (0, 1))})
    assert plan.input_boxes == {"e1": ((0, 1), (0, 3))}
    e1 = torch.arange(6.0).reshape(2, 3)
    got = plan.run({"e1": TensorPiece(data=e1[0:1], box=((0, 1), (0, 3)))})
    assert torch.equal(got["out"], e1.T[:, 0:1].unsqueeze(0))


def test_shared_input_feeds_two_groups() -> None:
    # A tied embedding: one input read into two outputs.
    mapper = ParallelMapper([RenameMapper("embed", "in.weight"), RenameMapper("embed", "out.weight")])
    state = {"embed": torch.randn(4, 2)}
    out = map_state_dict(mapper, state)
    assert torch.equal(out["in.weight"], state["embed"]) and torch.equal(out["out.weight"], state["embed"])


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        # step 1 reads a name step 0 does not produce
        ([IdentityMapper("a"), RenameMapper("zz", "b")], "does not produce: \\['zz'\\]"),
        # step 1 leaves a produced name unconsumed
        ([SelectMapper(["a", "b"]), IdentityMapper("a")], "does not consume .*\\['b'\\]"),
        # step 0 produces a name twice
        (
            [ParallelMapper([RenameMapper("a", "x"), RenameMapper("b", "x")]), IdentityMapper("x")],
            "more than once",
        ),
    ],
)
def test_sequential_mismatches_raise_naming_the_names(steps, message: str) -> None:
    with pytest.raises(StateMappingError, match=message):
        SequentialMapper(steps).groups()


def test_prefix_scopes_inputs_and_outputs() -> None:
    layer = ParallelMapper([ChunkMapper("qkv", ["q", "k", "v"]), RenameMapper("norm", "ln")])
    mapper = PrefixMapper(layer, input_prefix="layers.3.", output_prefix="model.layers.3.")
    state = {"layers.3.qkv": torch.arange(6.0), "layers.3.norm": torch.ones(2)}
    out = map_state_dict(mapper, state)
    assert set(out) == {f"model.layers.3.{n}" for n in ("q", "k", "v", "ln")}
    assert torch.equal(out["model.layers.3.k"], torch.tensor([2.0, 3.0]))


def test_filter_keeps_selected_outputs_and_still_consumes_all_inputs() -> None:
    # One pipeline stage holds layer 1 only; layer 0's inputs are consumed but never read.
    mapper = ParallelMapper([RenameMapper(f"hf.{i}", f"layers.{i}") for i in range(2)])
    mapper = FilterMapper(
        ParallelMapper([mapper, ChunkMapper("hf.gu", ["gate", "up"])]),
        lambda n: n not in {"layers.0", "up"},
    )
    groups = mapper.groups()
    assert {n for g in groups for n in g.inputs} == {"hf.0", "hf.1", "hf.gu"}
    assert {n for g in groups for n in g.outputs} == {"layers.1", "gate"}
    specs = {"hf.0": TensorSpec(shape=(2,), dtype=torch.float32)}
    dropped = next(g for g in groups if g.inputs == {"hf.0"})
    assert dropped.plan(specs, {}).input_boxes == {}
    state = {"hf.0": torch.zeros(2), "hf.1": torch.ones(2), "hf.gu": torch.arange(4.0)}
    out = map_state_dict(mapper, state)
    assert set(out) == {"layers.1", "gate"}
    assert torch.equal(out["gate"], torch.tensor([0.0, 1.0]))


def test_identity_mapper_from_module_covers_parameters_and_persistent_buffers() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    mapper = identity_mapper_from_module(module)
    names = {n for g in mapper.groups() for n in g.outputs}
    assert names == set(module.state_dict())
    assert "scratch" not in names and "1.running_mean" in names
    out = map_state_dict(mapper, module.state_dict())
    assert all(torch.equal(out[n], t) for n, t in module.state_dict().items())


def test_drop_in_sequence_removes_a_name() -> None:
    mapper = SequentialMapper(
        [SelectMapper(["a", "rotary"]), ParallelMapper([IdentityMapper("a"), DropMapper(["rotary"])])]
    )
    out = map_state_dict(mapper, {"a": torch.ones(1), "rotary": torch.ones(3)})
    assert set(out) == {"a"}
