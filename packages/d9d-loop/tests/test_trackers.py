import json
from pathlib import Path

from d9d.loop import JsonlTracker


def test_jsonl_tracker_drops_rerun_steps_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "m" / "metrics.jsonl"
    tracker = JsonlTracker(path)
    for step in range(5):
        tracker.log(step, {"loss": float(step)})
    tracker.on_resume(3)  # the run resumes at step 3: steps 3 and 4 will be logged again
    tracker.log(3, {"loss": 30.0})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
