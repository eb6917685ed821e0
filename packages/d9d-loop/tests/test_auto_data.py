import torch
from loop_toy_job import ToyDataset, collate

from d9d.loop import DataConfig, ShardedBatchSource


def source(dp_rank: int, dp_size: int, **config: object) -> ShardedBatchSource:  # type: ignore[type-arg]
    return ShardedBatchSource(
        dataset=ToyDataset(64),
        collator=collate,
        config=DataConfig.model_validate(config),
        global_batch_size=16,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def test_data_parallel_shards_concatenate_to_the_global_batch() -> None:
    whole = source(0, 1)
    shards = [source(r, 4) for r in range(4)]
    for _ in range(6):  # crosses an epoch boundary (4 steps per epoch)
        expected = whole.next_batch().x
        torch.testing.assert_close(torch.cat([s.next_batch().x for s in shards]), expected)


def test_epochs_use_a_new_order_and_resume_continues_exactly() -> None:
    a = source(1, 2)
    first_epoch = [a.next_batch().x for _ in range(4)]
    state = a.state_dict()
    expected_next = [a.next_batch().x for _ in range(3)]
    assert not torch.equal(expected_next[0], first_epoch[0])
    b = source(1, 2)
    b.load_state_dict(state)
    for want in expected_next:
        torch.testing.assert_close(b.next_batch().x, want)


def test_worker_processes_give_the_same_batches() -> None:
    plain, workers = source(0, 2), source(0, 2, num_workers=1)
    for _ in range(3):
        torch.testing.assert_close(workers.next_batch().y, plain.next_batch().y)


def test_no_shuffle_visits_in_order() -> None:
    s = source(0, 1, shuffle=False)
    torch.testing.assert_close(s.next_batch().x, ToyDataset(64).x[:16])
