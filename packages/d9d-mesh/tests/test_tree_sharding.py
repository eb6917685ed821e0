from dataclasses import dataclass

import pytest
import torch

from d9d.mesh import shard_tree, shard_tree_at, tree_tensors, unshard_tree


@dataclass
class Sample:
    x: torch.Tensor
    mask: dict[str, torch.Tensor]
    name: str


def make_sample() -> Sample:
    return Sample(
        x=torch.arange(24.0).reshape(8, 3),
        mask={"a": torch.arange(8), "b": torch.ones(8, 2)},
        name="batch",
    )


def test_shard_then_unshard_round_trips() -> None:
    sample = make_sample()
    shards = shard_tree(sample, num_shards=4)
    assert len(shards) == 4
    assert all(s.x.shape == (2, 3) and s.name == "batch" for s in shards)
    torch.testing.assert_close(shards[1].mask["a"], torch.tensor([2, 3]))
    joined = unshard_tree(shards)
    torch.testing.assert_close(joined.x, sample.x)
    torch.testing.assert_close(joined.mask["b"], sample.mask["b"])


def test_shard_at_matches_full_split() -> None:
    sample = make_sample()
    torch.testing.assert_close(
        shard_tree_at(sample, index=3, num_shards=4).x, shard_tree(sample, num_shards=4)[3].x
    )


def test_lists_tuples_and_other_dims() -> None:
    tree = (torch.zeros(2, 6), [torch.ones(3, 6)], None, 7)
    shards = shard_tree(tree, num_shards=3, dim=1)
    assert shards[0][0].shape == (2, 2)
    assert shards[0][1][0].shape == (3, 2)
    assert shards[2][2] is None and shards[2][3] == 7


def test_indivisible_tensor_is_named_by_path() -> None:
    with pytest.raises(ValueError, match=r"'mask.b' has size 8 along dim 0, not divisible into 3"):
        shard_tree({"mask": {"b": torch.ones(8)}}, num_shards=3)


def test_tree_tensors_lists_paths() -> None:
    assert [p for p, _ in tree_tensors(make_sample())] == ["x", "mask.a", "mask.b"]
