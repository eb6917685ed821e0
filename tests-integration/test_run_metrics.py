"""Step metrics on the quickstart: every step reports its throughput and its time split, consistently.

Nothing here depends on the machine's speed: the figures are checked against each other (the
smoothed throughput is the work of the window over the recorded step times, the phases fit in
the step), never against a wall-clock threshold. How the smoothing rides out stragglers is
tested with a clock of the test's own (packages/d9d-loop/tests/test_run_instruments.py).
"""

import json
from pathlib import Path

import pytest
import yaml
from quickstart_job import QUICKSTART, run_quickstart

WINDOW = 50  # the default trainer.logging.throughput_window
STEPS = 120


def test_every_step_reports_throughput_over_its_window_and_a_time_split_that_fits(tmp_path: Path) -> None:
    raw = yaml.safe_load((QUICKSTART.parent / "config.yaml").read_text())  # steps of 256 samples
    raw["trainer"]["device"] = "cpu"
    raw["trainer"]["max_steps"] = STEPS
    raw["lr_scheduler"]["warmup"] = {"steps": 5}
    raw["trainer"]["logging"] = {
        "progress_bar": False,
        "tracker": {"name": "jsonl", "path": str(tmp_path / "metrics.jsonl")},
    }
    run_quickstart(raw, num_samples=STEPS * 256)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))

    for index, r in enumerate(records):
        window = records[max(0, index - WINDOW + 1) : index + 1]
        expected = 256 * len(window) / sum(w["time/step_s"] for w in window)
        assert r["samples_per_s"] == pytest.approx(expected, rel=1e-6), r["step"]
        phases = r["time/data_s"] + r["time/forward_backward_s"] + r["time/optimizer_s"]
        assert 0 < phases <= r["time/step_s"]
        assert r["time/checkpoint_s"] >= 0
        assert phases + r["time/checkpoint_s"] <= r["time/step_s"] * (1 + 1e-9)
        assert r["memory/host_peak_gib"] > 0
