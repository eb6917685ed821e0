"""TensorBoard, W&B (offline) and Aim trackers write what they get, and resume into the same run."""

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from d9d.loop import (
    AimTrackerConfig,
    JsonlTracker,
    LoggingConfig,
    MissingExtraError,
    TensorBoardTrackerConfig,
    Tracker,
    WandbTrackerConfig,
)
from d9d.loop._optional_import import import_extra
from d9d.loop.observability._tracker_group import TrackerGroup, build_trackers
from d9d.loop.observability._trackers import build_tracker

METADATA = {"trainer": {"max_steps": 4}, "mesh": {"data_parallel_shard": 1}, "git_revision": "abc"}


def _log_run(tracker: Tracker, steps: range) -> dict[str, Any]:
    for step in steps:
        tracker.log(step, {"loss": float(step), "lr": 0.1})
    state = tracker.state_dict()
    tracker.close()
    return state


def _resume(tracker: Tracker, state: dict[str, Any], step: int) -> None:
    tracker.load_state_dict(state)
    tracker.on_resume(step)


def test_tensorboard_writes_scalars_and_metadata_and_purges_rerun_steps(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = TensorBoardTrackerConfig(directory=tmp_path)
    state = _log_run(build_tracker(config, metadata=METADATA), range(4))
    resumed = build_tracker(config, metadata=METADATA)  # a new process: a new default run name
    _resume(resumed, state, 2)  # resumed at step 2: steps 2 and 3 run again
    resumed.log(2, {"loss": 20.0, "lr": 0.1})
    resumed.close()

    runs = list(tmp_path.iterdir())
    assert len(runs) == 1, "the resumed run writes into the run directory it started in"
    events = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    text = events.Tensors("run_metadata/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"git_revision": "abc"' in text


def _wandb_records(path: Path) -> list[Any]:
    """The records of an offline W&B run file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending, records = 7, 32768, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (length == 0 and kind == 0):
            position += left  # block trailer / padding
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_writes_history_and_config_and_resumes_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # W&B waits 30 s for its service process and 90 s for a run to start: on a machine whose
    # cores are busy that is not enough, and the test would measure the machine, not the tracker.
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "600")
    config = WandbTrackerConfig(project="d9d-test", mode="offline", directory=tmp_path)
    first = build_tracker(config, metadata=METADATA)
    state = _log_run(first, range(3))
    resumed = build_tracker(config, metadata=METADATA)
    _resume(resumed, state, 3)
    resumed.log(3, {"loss": 3.0, "lr": 0.1})
    resumed.close()

    # W&B's service may still be flushing after finish() on a busy machine: read until the history
    # is complete, bounded by a deadline far beyond any machine's speed, not by a fixed sleep.
    expected = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    deadline = time.monotonic() + 300
    while True:
        files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
        try:
            steps, configs = _wandb_history(files)
        except Exception:  # a file still being written: a truncated header or record
            steps, configs = [], {}
        if (len(files) == 2 and sorted(steps) == expected) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(files) == 2
    assert {f.name for f in files} == {f"run-{state['run_id']}.wandb"}, "both parts are one run id"
    assert sorted(steps) == expected
    assert configs["git_revision"] == "abc" and configs["trainer"] == {"max_steps": 4}


def _wandb_history(files: list[Path]) -> tuple[list[tuple[int, float]], dict[str, Any]]:
    steps: list[tuple[int, float]] = []
    configs: dict[str, Any] = {}
    for file in files:
        for record in _wandb_records(file):
            match record.WhichOneof("record_type"):
                case "history":
                    items = {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
                    }
                    steps.append((items["_step"], items["loss"]))
                case "run":
                    configs |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
                case _:
                    pass
    return steps, configs


def test_aim_tracks_metrics_and_metadata_and_resumes_the_same_run(tmp_path: Path) -> None:
    import aim
    from aim.sdk.run import Context

    config = AimTrackerConfig(repo=str(tmp_path), experiment="d9d-test", run_name="toy")
    state = _log_run(build_tracker(config, metadata=METADATA), range(3))
    resumed = build_tracker(config, metadata=METADATA)
    _resume(resumed, state, 3)
    resumed.log(3, {"loss": 3.0, "lr": 0.1})
    assert resumed.state_dict() == state, "the resumed job continues the same run"
    resumed.close()

    run = aim.Run(run_hash=state["run_hash"], repo=str(tmp_path))
    loss = run.get_metric("loss", Context({}))
    assert [(step, value[0]) for step, value in loss.data.items()] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert run["d9d"]["git_revision"] == "abc"
    assert run.name == "toy"
    run.close()


def test_group_writes_to_every_tracker_and_keeps_their_states_by_name(tmp_path: Path) -> None:
    group = build_trackers(
        LoggingConfig(
            tracker={"name": "jsonl", "path": tmp_path / "a.jsonl"},
            trackers=[{"name": "jsonl", "path": tmp_path / "b.jsonl"}],
        ).chosen_trackers,
        metadata=METADATA,
    )
    assert isinstance(group, TrackerGroup)
    group.log(0, {"loss": 1.0})
    group.close()
    for name in ("a", "b"):
        assert json.loads((tmp_path / f"{name}.jsonl").read_text()) == {"step": 0, "loss": 1.0}
    assert group.state_dict() == {"jsonl": {}, "jsonl_1": {}}


@pytest.mark.parametrize(
    ("logging", "names"),
    [
        ({}, []),  # nothing but the progress bar
        ({"tracker": {"name": "jsonl", "path": "m.jsonl"}}, ["jsonl"]),  # the single-tracker key
        (
            {"trackers": [{"name": "tensorboard", "directory": "tb"}, {"name": "wandb", "project": "p"}]},
            ["tensorboard", "wandb"],
        ),  # several at once
    ],
)
def test_logging_config_chooses_trackers(logging: dict[str, Any], names: list[str]) -> None:
    assert [t.name for t in LoggingConfig.model_validate(logging).chosen_trackers] == names


def test_single_tracker_is_not_wrapped(tmp_path: Path) -> None:
    tracker = build_trackers(
        LoggingConfig(tracker={"name": "jsonl", "path": tmp_path / "m.jsonl"}).chosen_trackers, metadata={}
    )
    assert isinstance(tracker, JsonlTracker)  # checkpoints keep the tracker's own state


def test_a_missing_extra_names_it() -> None:
    with pytest.raises(MissingExtraError, match=r"pip install 'd9d-loop\[aim\]' \(or 'd9d\[aim\]'\)"):
        import_extra("d9d_no_such_module", extra="aim", feature="the aim tracker")
