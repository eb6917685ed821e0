"""The memo of values derived from the last few distinct tensors (document offsets, block masks)."""

import gc
import weakref

import pytest
import torch

from d9d.kernels.layers._recent_tensor_memo import RecentTensorMemo


class _Counted:
    """``tensor.sum()`` as a Python int, counting the tensors it was computed for."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, tensor: torch.Tensor) -> int:
        self.seen.append(id(tensor))
        return int(tensor.sum().item())


def test_alternating_two_tensors_computes_each_once() -> None:
    compute = _Counted()
    memo = RecentTensorMemo(compute)
    first, second = torch.tensor([1, 2]), torch.tensor([3, 4])
    # microbatch 1 forward, microbatch 2 forward, microbatch 1 recomputed for its backward, ...
    for _ in range(3):
        assert memo(first) == 3
        assert memo(second) == 7
    assert compute.seen == [id(first), id(second)]
    assert len(memo) == 2


def test_an_in_place_change_computes_again_and_replaces_the_entry() -> None:
    compute = _Counted()
    memo = RecentTensorMemo(compute)
    ids = torch.tensor([1, 2])
    assert memo(ids) == 3
    ids[0] = 10  # a reused input buffer refilled in place
    assert memo(ids) == 12
    assert memo(ids) == 12
    assert len(compute.seen) == 2
    assert len(memo) == 1  # the old contents' entry was replaced, not kept beside


def test_an_equal_but_distinct_tensor_is_computed_anew() -> None:
    compute = _Counted()
    memo = RecentTensorMemo(compute)
    ids = torch.tensor([1, 2])
    memo(ids)
    memo(ids.clone())
    assert len(compute.seen) == 2


def test_a_freed_tensor_is_not_kept_alive_and_its_entry_goes() -> None:
    memo = RecentTensorMemo(_Counted())
    kept = torch.tensor([5])
    freed = torch.tensor([1, 2, 3])
    memo(kept)
    memo(freed)
    gone = weakref.ref(freed)
    del freed
    gc.collect()
    assert gone() is None
    assert len(memo) == 1
    assert memo(kept) == 5


def test_a_new_tensor_at_a_freed_tensors_address_is_computed_anew() -> None:
    # ids are reused: an entry is found by identity through its weak reference, never by id alone
    compute = _Counted()
    memo = RecentTensorMemo(compute)
    for value in range(20):
        assert memo(torch.tensor([value])) == value
    assert len(compute.seen) == 20


def test_beyond_capacity_the_least_recently_used_tensor_goes() -> None:
    compute = _Counted()
    memo = RecentTensorMemo(compute, capacity=2)
    a, b, c = torch.tensor([1]), torch.tensor([2]), torch.tensor([3])
    memo(a)
    memo(b)
    memo(a)  # a is now the most recently used: c pushes out b
    memo(c)
    assert len(memo) == 2
    calls = len(compute.seen)
    memo(a)
    memo(c)
    assert len(compute.seen) == calls
    memo(b)
    assert compute.seen[-1] == id(b)
    assert len(compute.seen) == calls + 1


def test_the_default_capacity_keeps_eight_tensors() -> None:
    compute = _Counted()
    memo = RecentTensorMemo(compute)
    tensors = [torch.tensor([n]) for n in range(9)]
    for tensor in tensors:
        memo(tensor)
    assert len(memo) == 8
    for tensor in tensors[1:]:
        memo(tensor)
    assert len(compute.seen) == 9
    memo(tensors[0])
    assert len(compute.seen) == 10


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_capacity_below_one_is_refused(capacity: int) -> None:
    with pytest.raises(ValueError, match=f"capacity must be at least 1, got {capacity}"):
        RecentTensorMemo(_Counted(), capacity=capacity)


def test_inference_tensors_are_never_kept() -> None:
    compute = _Counted()
    memo = RecentTensorMemo(compute)
    with torch.inference_mode():
        frozen = torch.tensor([1, 2])
    assert memo(frozen) == 3
    assert memo(frozen) == 3
    assert len(compute.seen) == 2
    assert len(memo) == 0


def test_a_failing_compute_keeps_nothing_of_the_tensors_old_contents() -> None:
    def positive_sum(tensor: torch.Tensor) -> int:
        if bool((tensor < 0).any()):
            raise ValueError("negative")
        return int(tensor.sum().item())

    memo = RecentTensorMemo(positive_sum)
    ids = torch.tensor([1, 2])
    assert memo(ids) == 3
    ids[0] = -1
    with pytest.raises(ValueError, match="negative"):
        memo(ids)
    assert len(memo) == 0
    ids[0] = 4
    assert memo(ids) == 6
