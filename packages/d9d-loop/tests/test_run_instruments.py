"""The profiler window, GC control, the step-time split and smoothed throughput."""

import gc
import json
from pathlib import Path

import pytest
from loop_toy_job import build_trainer, toy_config

from d9d.loop import EventBus, GarbageCollectionConfig, StepFinished
from d9d.loop.observability._gc_control import GarbageCollection
from d9d.loop.observability._step_metrics import StepMetrics, StepWork
from d9d.loop.observability._step_timing import StepTimer
from d9d.loop.observability._throughput import SmoothedThroughput
from d9d.mesh.testing import run_distributed


def _profiled_run(directory: str) -> None:
    config = toy_config(
        trainer={
            "max_steps": 4,
            "profiling": {"start_step": 1, "steps": 2, "ranks": [1], "directory": directory},
        },
        mesh={"data_parallel_shard": 2},
    )
    with build_trainer(config) as trainer:
        trainer.train()


def test_profiler_writes_a_trace_of_exactly_the_asked_steps_and_ranks(tmp_path: Path) -> None:
    run_distributed(_profiled_run, str(tmp_path), world_size=2, timeout_s=240)
    assert [p.name for p in tmp_path.iterdir()] == ["rank1_steps1-2.json"]  # rank 0 was not asked
    events = json.loads((tmp_path / "rank1_steps1-2.json").read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if str(e.get("name", "")).startswith("train_step#")})
    assert steps == ["train_step#1", "train_step#2"]


def test_step_timer_splits_a_step_into_phases() -> None:
    now = iter([0.0, 1.0, 3.0, 6.0, 6.5, 10.0, 10.5, 11.0, 11.5, 12.0]).__next__
    timer = StepTimer(clock=now)
    timer.start()  # 0
    timer.lap("data")  # 1
    timer.lap("forward_backward")  # 3
    timer.lap("optimizer")  # 6
    first = timer.finish()  # 6.5
    assert (first.data, first.forward_backward, first.optimizer, first.checkpoint, first.wall) == (
        1.0,
        2.0,
        3.0,
        0.0,
        6.5,
    )
    timer.start()  # 10: 3.5 s after the previous step ended (a checkpoint)
    timer.lap("data")  # 10.5
    timer.lap("forward_backward")  # 11
    timer.lap("optimizer")  # 11.5
    second = timer.finish()  # 12
    assert (second.checkpoint, second.wall) == (3.5, 5.5)


def test_throughput_is_work_over_time_of_the_last_window_steps() -> None:
    throughput = SmoothedThroughput(window=2)
    throughput.add(seconds=10.0, samples=8, tokens=0)  # a slow first step
    throughput.add(seconds=1.0, samples=8, tokens=80)
    assert throughput.samples_per_second == 16 / 11
    throughput.add(seconds=1.0, samples=8, tokens=80)  # the slow step leaves the window
    assert (throughput.samples_per_second, throughput.tokens_per_second) == (8.0, 80.0)


class _Clock:
    """A host clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_smoothed_throughput_stays_within_20_percent_of_the_mean_despite_stragglers() -> None:
    # 300 steps of 10 ms with a 0.2 s warm-up step and two 0.1 s stalls (Python's GC in a busy
    # process, a checkpoint): what a user watches stays within 20% of the run's mean once the
    # warm-up left the window. The clock is the test's, so the machine's speed does not matter.
    clock, window = _Clock(), 50
    metrics = StepMetrics(window=window, clock=clock)
    stalls = {0: 0.19, 150: 0.1, 220: 0.1}
    records: list[dict[str, float]] = []
    for step in range(300):
        metrics.start()
        clock.now += 0.004 + stalls.get(step, 0.0)
        metrics.lap("data")
        clock.now += 0.005
        metrics.lap("forward_backward")
        clock.now += 0.001
        metrics.lap("optimizer")
        records.append(metrics.figures(metrics.end(), StepWork(samples=256, tokens=0)))
    steady = records[window:]  # the mean: all samples over all time, after the warm-up's window
    mean = 256 * len(steady) / sum(r["time/step_s"] for r in steady)
    rates = [r["samples_per_s"] for r in records]
    strays = [
        (step, rate / mean)
        for step, rate in enumerate(rates)
        if step >= window and abs(rate / mean - 1) >= 0.2
    ]
    assert not strays
    assert rates[window - 1] < 0.8 * mean  # the warm-up step is still in the window
    assert rates[-1] == pytest.approx(256 / 0.01, rel=1e-9)  # work over time of the last window


def test_gc_is_off_during_training_and_collects_every_n_steps() -> None:
    collections: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    control = GarbageCollection(GarbageCollectionConfig(every_steps=3, generation=1))
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        control.step_started()
        assert not gc.isenabled()
        gc.callbacks.append(record)
        for step in range(7):
            control.step_started()
            control.step_finished(step)
        gc.callbacks.remove(record)
        assert collections == [1, 1]  # after steps 2 and 5
        control.close()
        assert gc.isenabled()
    finally:
        if not was_enabled:
            gc.disable()


def _gc_enabled_during_and_after_training() -> tuple[list[bool], bool]:
    config = toy_config(trainer={"max_steps": 3})
    assert config.trainer.garbage_collection == GarbageCollectionConfig(every_steps=50, generation=1)
    events = EventBus()
    during: list[bool] = []
    events.subscribe(StepFinished, lambda _e: during.append(gc.isenabled()))
    trainer = build_trainer(config, events=events)
    try:
        trainer.train()
    finally:
        trainer.close()
    return during, gc.isenabled()


def test_automatic_gc_is_off_while_training_by_default() -> None:
    # A full automatic collection of a compiled model's process can stall a step for most of a
    # second, at a different step on every rank: by default the loop collects at fixed steps.
    gc.enable()
    during, after = run_distributed(_gc_enabled_during_and_after_training, world_size=1)[0]
    assert during == [False, False, False]
    assert after
