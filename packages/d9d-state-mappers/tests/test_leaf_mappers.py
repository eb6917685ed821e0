"""Leaf mappers: whole tensors match torch ops, and every slice plan reproduces the slice exactly."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from d9d.state_mappers import (
    CastMapper,
    ChunkMapper,
    ConcatenateMapper,
    DropMapper,
    IdentityMapper,
    MapperGroup,
    PermuteMapper,
    RenameMapper,
    ReshapeMapper,
    SelectMapper,
    StackMapper,
    StateMapper,
    TensorPiece,
    TensorSpec,
    TransposeMapper,
    UnstackMapper,
    map_state_dict,
)


def _t(*shape: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


STATE = {
    "a": _t(6, 4),
    "b": _t(3, 4, offset=100),
    "c": _t(2, 4, offset=200),
    "x3": _t(2, 3, 4, offset=300),
}

# (mapper, inputs it reads, expected outputs computed with torch)
CASES: list[
    tuple[StateMapper, dict[str, torch.Tensor], Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]]
] = [
    # identity keeps name and data
    (IdentityMapper("a"), {"a": STATE["a"]}, lambda s: {"a": s["a"]}),
    # rename changes only the name
    (RenameMapper("a", "z"), {"a": STATE["a"]}, lambda s: {"z": s["a"]}),
    # 2-D transpose
    (TransposeMapper("a", target="t"), {"a": STATE["a"]}, lambda s: {"t": s["a"].T}),
    # 3-D permute
    (PermuteMapper("x3", [2, 0, 1]), {"x3": STATE["x3"]}, lambda s: {"x3": s["x3"].permute(2, 0, 1)}),
    # reshape with an inferred dim
    (ReshapeMapper("x3", [-1, 4], target="r"), {"x3": STATE["x3"]}, lambda s: {"r": s["x3"].reshape(6, 4)}),
    # dtype cast
    (CastMapper("a", torch.bfloat16), {"a": STATE["a"]}, lambda s: {"a": s["a"].to(torch.bfloat16)}),
    # stack along a new leading dim (per-expert -> fused)
    (
        StackMapper(["b", "c2"], "s", dim=1),
        {"b": STATE["b"], "c2": STATE["b"] + 1},
        lambda s: {"s": torch.stack([s["b"], s["c2"]], dim=1)},
    ),
    # unstack along dim 1
    (
        UnstackMapper("x3", ["u0", "u1", "u2"], dim=1),
        {"x3": STATE["x3"]},
        lambda s: {f"u{i}": s["x3"][:, i] for i in range(3)},
    ),
    # concatenate unequal sizes (fused QKV)
    (
        ConcatenateMapper(["a", "b", "c"], "qkv"),
        {k: STATE[k] for k in "abc"},
        lambda s: {"qkv": torch.cat([s["a"], s["b"], s["c"]])},
    ),
    # chunk into unequal sizes (GQA QKV)
    (
        ChunkMapper("a", ["q", "k", "v"], sizes=[3, 2, 1]),
        {"a": STATE["a"]},
        lambda s: dict(zip("qkv", torch.split(s["a"], [3, 2, 1]), strict=True)),
    ),
    # chunk into equal parts along dim 1 (fused gate/up)
    (
        ChunkMapper("a", ["g", "u"], dim=1),
        {"a": STATE["a"]},
        lambda s: dict(zip("gu", s["a"].chunk(2, dim=1), strict=True)),
    ),
    # select passes named tensors through
    (SelectMapper(["a", "b"]), {"a": STATE["a"], "b": STATE["b"]}, lambda s: {"a": s["a"], "b": s["b"]}),
    # drop consumes and produces nothing
    (DropMapper(["a"]), {"a": STATE["a"]}, lambda s: {}),
]


@pytest.mark.parametrize(("mapper", "inputs", "expected"), CASES)
def test_whole_tensors_match_torch(mapper: StateMapper, inputs, expected) -> None:
    out = map_state_dict(mapper, inputs)
    reference = expected(inputs)
    assert set(out) == set(reference)
    for name, tensor in reference.items():
        assert out[name].dtype == tensor.dtype
        assert torch.equal(out[name], tensor), name


def _all_boxes(shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    spans = [[(s, e) for s in range(n + 1) for e in range(s, n + 1)] for n in shape]
    boxes = list(itertools.product(*spans))
    return boxes[:: max(1, len(boxes) // 60)]


@pytest.mark.parametrize(("mapper", "inputs", "expected"), CASES)
def test_every_slice_plan_reads_a_slice_and_reproduces_it(mapper: StateMapper, inputs, expected) -> None:
    reference = expected(inputs)
    specs = {n: TensorSpec.of(t) for n, t in inputs.items()}
    for group in mapper.groups():
        assert isinstance(group, MapperGroup)
        group_specs = {n: specs[n] for n in group.inputs}
        for name in group.outputs:
            for box in _all_boxes(tuple(reference[name].shape)):
                plan = group.plan(group_specs, {name: box})
                pieces = {
                    n: TensorPiece(
                        data=TensorPiece(data=inputs[n], box=tuple((0, s) for s in inputs[n].shape))
                        .narrow(b)
                        .clone(),
                        box=b,
                    )
                    for n, b in plan.input_boxes.items()
                }
                got = plan.run(pieces)
                want = TensorPiece(
                    data=reference[name], box=tuple((0, s) for s in reference[name].shape)
                ).narrow(box)
                assert set(got) == {name}
                assert torch.equal(got[name], want), (name, box)


def test_stack_slice_reads_only_the_covered_sources() -> None:
    # Experts 1..2 of a fused (4, 3) stack come from sources e1 and e2 only.
    group = StackMapper([f"e{i}" for i in range(4)], "fused")
    specs = {f"e{i}": TensorSpec(shape=(3,), dtype=torch.float32) for i in range(4)}
    plan = group.plan(specs, {"fused": ((1, 3), (0, 3))})
    assert plan.input_boxes == {"e1": ((0, 3),), "e2": ((0, 3),)}


def test_concatenate_slice_reads_only_overlapping_parts() -> None:
    # Rows 5..9 of cat(q[6], k[2], v[2]) are q[5:6], k[0:2], v[0:1].
    group = ConcatenateMapper(["q", "k", "v"], "qkv")
    specs = {"q": TensorSpec(shape=(6, 4), dtype=torch.float32)}
    specs |= {n: TensorSpec(shape=(2, 4), dtype=torch.float32) for n in "kv"}
    plan = group.plan(specs, {"qkv": ((5, 9), (0, 4))})
    assert plan.input_boxes == {"q": ((5, 6), (0, 4)), "k": ((0, 2), (0, 4)), "v": ((0, 1), (0, 4))}


def test_transpose_slice_swaps_box_dims() -> None:
    group = TransposeMapper("w")
    plan = group.plan({"w": TensorSpec(shape=(4, 6), dtype=torch.float32)}, {"w": ((0, 3), (1, 2))})
    assert plan.input_boxes == {"w": ((1, 2), (0, 3))}


@pytest.mark.parametrize(
    ("mapper", "specs", "message"),
    [
        # stacked tensors must match
        (
            StackMapper(["a", "b"], "s"),
            {"a": ((2,), torch.float32), "b": ((3,), torch.float32)},
            "'b' is float32",
        ),
        # concatenated tensors must agree outside the dim
        (
            ConcatenateMapper(["a", "b"], "s"),
            {"a": ((2, 3), torch.float32), "b": ((2, 4), torch.float32)},
            "along dim 0",
        ),
        # equal chunks must divide the dim
        (ChunkMapper("a", ["x", "y"]), {"a": ((3,), torch.float32)}, "does not split into 2"),
        # unstack needs one name per index
        (UnstackMapper("a", ["x"]), {"a": ((2, 3), torch.float32)}, "2 but 1 targets"),
        # reshape must keep the element count
        (ReshapeMapper("a", [5]), {"a": ((2, 3), torch.float32)}, "cannot reshape 'a'"),
        # permute needs a dim per entry
        (PermuteMapper("a", [1, 0]), {"a": ((2, 3, 4), torch.float32)}, "needs 2 tensor dims"),
    ],
)
def test_operations_that_do_not_fit_raise_naming_the_tensor(mapper: MapperGroup, specs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mapper.infer({n: TensorSpec(shape=s, dtype=d) for n, (s, d) in specs.items()})


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: PermuteMapper("a", [0, 0]), "not a permutation"),  # repeated dim
        (lambda: StackMapper(["a", "a"], "s"), "names repeat"),  # a source twice
        (lambda: ChunkMapper("a", ["x", "y"], sizes=[1]), "1 sizes for 2 targets"),  # sizes per target
        (lambda: ReshapeMapper("a", [-1, -1]), "invalid shape"),  # two inferred dims
    ],
)
def test_invalid_construction_raises(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
