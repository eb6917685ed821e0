import pytest

from d9d.pipeline import PipelineStageInfo, assign_layers, layers_of_stage


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "first", "last", "sizes"),
    [
        (8, 4, 0.0, 0.0, [2, 2, 2, 2]),  # even split
        (10, 4, 0.0, 0.0, [3, 3, 2, 2]),  # remainder goes to the earlier stages
        (8, 4, 2.0, 2.0, [1, 3, 3, 1]),  # embedding and head worth two layers each
        (6, 3, 0.0, 3.0, [3, 3, 0]),  # a heavy head takes a whole share
        (3, 4, 0.0, 0.0, [1, 1, 1, 0]),  # fewer layers than stages
    ],
)
def test_assign_layers(num_layers: int, num_stages: int, first: float, last: float, sizes: list[int]) -> None:
    ranges = assign_layers(num_layers, num_stages, first_stage_weight=first, last_stage_weight=last)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(num_layers))


def test_layers_of_stage() -> None:
    assert layers_of_stage(PipelineStageInfo(1, 3), 7) == range(3, 5)


def test_stage_info() -> None:
    first, last = PipelineStageInfo(0, 2), PipelineStageInfo(1, 2)
    assert first.is_first and not first.is_last
    assert last.is_last and not last.is_first
    with pytest.raises(ValueError, match=r"current_stage=2 is outside \[0, num_stages=2\)"):
        PipelineStageInfo(2, 2)
    with pytest.raises(ValueError, match="last_stage_weight=-1"):
        assign_layers(4, 2, last_stage_weight=-1)
