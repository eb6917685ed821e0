"""Positions and document ids of packed sequences."""

import pytest
import torch

from d9d.kernels.layers import (
    DocumentOffsets,
    cu_seqlens_from_document_ids,
    document_ids_from_cu_seqlens,
    document_ids_from_position_ids,
    position_ids_from_document_ids,
)


def test_positions_restart_per_document_and_per_row() -> None:
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 7, 7]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    torch.testing.assert_close(position_ids_from_document_ids(document_ids), expected)


def test_document_ids_from_positions_round_trip() -> None:
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    document_ids = document_ids_from_position_ids(position_ids)
    torch.testing.assert_close(document_ids, torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]))
    torch.testing.assert_close(position_ids_from_document_ids(document_ids), position_ids)


def test_cu_seqlens_round_trip() -> None:
    cu_seqlens = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    document_ids = document_ids_from_cu_seqlens(cu_seqlens)
    torch.testing.assert_close(document_ids, torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, 2]]))
    back, longest = cu_seqlens_from_document_ids(document_ids)
    torch.testing.assert_close(back, cu_seqlens)
    assert longest == 5


def test_cu_seqlens_split_documents_at_row_boundaries() -> None:
    # the same id continuing into the next row is still a new document there
    document_ids = torch.tensor([[0, 0, 1], [1, 1, 1]])
    cu_seqlens, longest = cu_seqlens_from_document_ids(document_ids)
    torch.testing.assert_close(cu_seqlens, torch.tensor([0, 2, 3, 6], dtype=torch.int32))
    assert longest == 3


def test_cu_seqlens_of_random_layouts_match_the_runs_counted_by_hand() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch, seq = (int(n) for n in torch.randint(1, 9, (2,), generator=generator))
        document_ids = torch.randint(0, 3, (batch, seq), generator=generator).cummax(dim=1).values
        lengths: list[int] = []
        for row in document_ids.tolist():
            for i, value in enumerate(row):
                if i == 0 or value != row[i - 1]:
                    lengths.append(0)
                lengths[-1] += 1
        cu_seqlens, longest = cu_seqlens_from_document_ids(document_ids)
        expected = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        torch.testing.assert_close(cu_seqlens, expected)
        assert longest == max(lengths)


def test_document_offsets_are_found_once_per_tensor_and_again_after_an_in_place_change() -> None:
    offsets = DocumentOffsets()
    document_ids = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 2, 3]])
    first = offsets(document_ids)
    assert offsets(document_ids) is first  # the next layer's call: no new host sync
    torch.testing.assert_close(first[0], torch.tensor([0, 2, 5, 9, 10], dtype=torch.int32))
    document_ids[1] = 7  # a reused input buffer refilled in place
    cu_seqlens, longest = offsets(document_ids)
    torch.testing.assert_close(cu_seqlens, torch.tensor([0, 2, 5, 10], dtype=torch.int32))
    assert longest == 5
    same_values = document_ids.clone()
    assert offsets(same_values) is not offsets(document_ids)  # another tensor is looked at anew
    with torch.inference_mode():
        frozen = torch.tensor([[0, 1, 1]])
        torch.testing.assert_close(offsets(frozen)[0], torch.tensor([0, 1, 3], dtype=torch.int32))


def test_document_offsets_of_alternating_microbatches_are_found_once_each() -> None:
    # a pipeline schedule: microbatch 1 forward, microbatch 2 forward, microbatch 1's backward
    # recompute with its document_ids again
    offsets = DocumentOffsets()
    first = torch.tensor([[0, 0, 1, 1, 1]])
    second = torch.tensor([[0, 1, 1, 1, 1]])
    found = offsets(first), offsets(second)
    assert offsets(first) is found[0]
    assert offsets(second) is found[1]
    torch.testing.assert_close(found[1][0], torch.tensor([0, 1, 5], dtype=torch.int32))


def test_a_document_split_into_two_runs_is_refused_naming_row_document_and_token() -> None:
    document_ids = torch.tensor([[0, 0, 1, 1], [3, 3, 4, 3]])
    with pytest.raises(ValueError, match="row 1: document 3 comes back at token 3"):
        cu_seqlens_from_document_ids(document_ids)
    # decreasing ids are still one run each
    cu_seqlens, _ = cu_seqlens_from_document_ids(torch.tensor([[5, 5, 2, 2, 2]]))
    torch.testing.assert_close(cu_seqlens, torch.tensor([0, 2, 5], dtype=torch.int32))
