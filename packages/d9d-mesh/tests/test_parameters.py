import pytest
from pydantic import ValidationError

from d9d.mesh import MeshParameters


def test_defaults_are_a_world_of_one() -> None:
    params = MeshParameters()
    assert params.world_size == 1
    assert params.ranks_per_stage == 1


@pytest.mark.parametrize(
    ("fields", "world_size"),
    [
        ({"data_parallel_shard": 4}, 4),
        ({"data_parallel_replicate": 2, "data_parallel_shard": 2}, 4),
        ({"pipeline_parallel": 2, "tensor_parallel": 2, "context_parallel_shard": 2}, 8),
        # expert parallelism adds no ranks: it reuses the ranks of a stage
        ({"data_parallel_shard": 4, "expert_parallel": 4}, 4),
    ],
)
def test_world_size_is_product_of_dense_degrees(fields: dict[str, int], world_size: int) -> None:
    assert MeshParameters(**fields).world_size == world_size


def test_misspelled_key_is_named() -> None:
    with pytest.raises(ValidationError, match="data_paralel_shard"):
        MeshParameters.model_validate({"data_paralel_shard": 2})


@pytest.mark.parametrize("value", [0, -1])
def test_degree_below_one_is_named(value: int) -> None:
    with pytest.raises(ValidationError, match="tensor_parallel"):
        MeshParameters(tensor_parallel=value)


def test_expert_degree_must_divide_stage_ranks() -> None:
    with pytest.raises(ValidationError, match="expert_parallel=3 does not divide"):
        MeshParameters(data_parallel_shard=4, expert_parallel=3)


def test_world_size_mismatch_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"mesh needs 4 ranks .* world size is 2"):
        MeshParameters(data_parallel_shard=4).check_world_size(2)


def test_is_frozen() -> None:
    params = MeshParameters()
    with pytest.raises(ValidationError):
        params.tensor_parallel = 2  # type: ignore[misc]
