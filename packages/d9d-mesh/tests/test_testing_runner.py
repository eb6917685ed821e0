import multiprocessing
import os
import pickle
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from d9d.mesh.testing import DistributedTestError, _runner, run_distributed
from d9d.mesh.testing._zygote import ZYGOTE_ENV


def _rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def test_returns_each_ranks_value_in_rank_order() -> None:
    assert run_distributed(_rank_and_sum, world_size=4) == [(r, 6.0) for r in range(4)]


def _fail_on_rank_two() -> None:
    if dist.get_rank() == 2:
        raise RuntimeError("boom on purpose")


def test_failure_names_rank_and_traceback() -> None:
    with pytest.raises(DistributedTestError, match=r"(?s)1 of 3 ranks failed.*rank 2.*boom on purpose"):
        run_distributed(_fail_on_rank_two, world_size=3)


def _hang_on_rank_one() -> None:
    if dist.get_rank() == 1:
        time.sleep(60)


def test_hung_rank_is_killed_and_named() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 1 ---\ndid not finish within 2 s"):
        run_distributed(_hang_on_rank_one, world_size=2, timeout_s=2.0)


def _hard_exit() -> None:
    if dist.get_rank() == 0:
        os._exit(3)


def test_crashed_rank_reports_exit_code() -> None:
    with pytest.raises(DistributedTestError, match="exited with code 3"):
        run_distributed(_hard_exit, world_size=2, timeout_s=120.0)  # the exit is seen at once


def _backward_works() -> float:
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()
    assert x.grad is not None
    return float(x.grad.sum())


def test_ranks_can_use_autograd_after_the_parent_did() -> None:
    # PyTorch forbids autograd in a child forked after the parent ran backward; the pytest
    # plugin's zygote (forked before any test ran) keeps this working.
    y = torch.ones(2, requires_grad=True)
    (y * 3).sum().backward()
    assert run_distributed(_backward_works, world_size=2) == [6.0, 6.0]


def _backward_with_module(module: object) -> float:
    assert module is sys.modules[__name__]  # the same module object, resolved by name
    return _backward_works()


def test_module_arguments_travel_by_name_to_the_clean_zygote() -> None:
    # e.g. a conftest module handed to ranks as a fixture; the parent has already run backward
    y = torch.ones(2, requires_grad=True)
    (y * 3).sum().backward()
    assert run_distributed(_backward_with_module, sys.modules[__name__], world_size=2) == [6.0, 6.0]


def _rank_of_world() -> int:
    return dist.get_rank()


def _rank_zero_alone(store_path: str, fn: object, *, world_size: int, collective_timeout_s: float) -> Any:
    """Forks rank 0 of a world of ``world_size`` (no other rank starts) and returns its outcome."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    args = (0, world_size, store_path, fn, (), {}, timedelta(seconds=collective_timeout_s), send)
    process = ctx.Process(target=_runner._worker, args=args, daemon=True)
    process.start()
    send.close()
    assert recv.poll(60)
    outcome = pickle.loads(recv.recv_bytes())
    process.join(timeout=10)
    return outcome


def test_a_rank_that_cannot_join_the_group_says_so(tmp_path) -> None:
    # rank 0 of a world of 2 whose rank 1 never comes: init_process_group fails, fn never runs
    outcome = _rank_zero_alone(str(tmp_path / "store"), _rank_of_world, world_size=2, collective_timeout_s=1)
    assert not outcome.ok and not outcome.joined
    assert "init_process_group" in outcome.traceback


def test_a_world_whose_rendezvous_failed_starts_once_more(monkeypatch: pytest.MonkeyPatch) -> None:
    worlds: list[object] = []
    real_world = _runner._run_world

    def first_rendezvous_fails(request: object) -> list[object]:
        worlds.append(request)
        if len(worlds) == 1:
            return [
                _runner._RankOutcome(rank=0, ok=False, joined=False, traceback="connectFullMesh failed"),
                _runner._RankOutcome(rank=1, ok=False, traceback="did not finish"),
            ]
        return real_world(request)  # type: ignore[arg-type]

    monkeypatch.setattr(_runner, "_run_world", first_rendezvous_fails)
    request = _runner._Request(
        fn=_rank_of_world, args=(), kwargs={}, world_size=2, timeout_s=60.0, collective_timeout_s=30.0
    )
    outcomes = _runner._run_forked(request)
    assert len(worlds) >= 2  # a real world may itself need another start on a busy host
    assert [o.value for o in outcomes] == [0, 1]


def _subgroup_rendezvous_fails() -> None:
    raise RuntimeError(
        "Gloo connectFullMesh failed with [pair.cc:561] Connection closed by peer [127.0.0.1]:59545"
    )


def _fails_otherwise() -> None:
    raise RuntimeError("boom on purpose")


@pytest.mark.parametrize(
    ("fn", "marked"), [(_subgroup_rendezvous_fails, True), (_fails_otherwise, False)], ids=["gloo", "other"]
)
def test_a_rank_whose_subgroup_rendezvous_failed_is_marked(tmp_path, fn: object, marked: bool) -> None:
    # a world of one rank, whose fn raises after the world group has joined
    outcome = _rank_zero_alone(str(tmp_path / "store"), fn, world_size=1, collective_timeout_s=30)
    assert not outcome.ok and outcome.joined  # fn ran: the world group had joined
    assert outcome.subgroup_rendezvous_failed is marked


def test_a_world_whose_subgroup_rendezvous_failed_in_fn_starts_once_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worlds: list[object] = []
    real_world = _runner._run_world

    def first_subgroup_fails(request: object) -> list[object]:
        worlds.append(request)
        if len(worlds) == 1:
            return [
                _runner._RankOutcome(rank=0, ok=True, value=0),
                _runner._RankOutcome(
                    rank=1, ok=False, traceback="connectFullMesh failed", subgroup_rendezvous_failed=True
                ),
            ]
        return real_world(request)  # type: ignore[arg-type]

    monkeypatch.setattr(_runner, "_run_world", first_subgroup_fails)
    request = _runner._Request(
        fn=_rank_of_world, args=(), kwargs={}, world_size=2, timeout_s=60.0, collective_timeout_s=30.0
    )
    outcomes = _runner._run_forked(request)
    assert len(worlds) >= 2
    assert [o.value for o in outcomes] == [0, 1]


def test_a_world_that_never_joins_stops_after_three_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[object] = []

    def never_joins(request: object) -> list[object]:
        starts.append(request)
        return [_runner._RankOutcome(rank=0, ok=False, joined=False, traceback="connectFullMesh failed")]

    monkeypatch.setattr(_runner, "_run_world", never_joins)
    monkeypatch.delenv(ZYGOTE_ENV, raising=False)  # fork from here: the fake world is patched in
    with pytest.raises(DistributedTestError, match="connectFullMesh failed"):
        run_distributed(_rank_of_world, world_size=1)
    assert len(starts) == 3
