"""``d9d lr-plot`` draws the configured schedule: the curve is the scheduler's learning rate."""

from pathlib import Path

import pytest
import yaml

from d9d._loop_command import main
from d9d.loop import PiecewiseLRSchedulerConfig, PiecewiseSchedule
from d9d.loop._lr_plot import lr_schedule_values, plot_lr_schedule

CONFIG = {
    "trainer": {"max_steps": 300, "global_batch_size": 256, "microbatch_size": 64},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "lr_scheduler": {
        "name": "piecewise",
        "warmup": {"steps": 20},
        "phases": [{"kind": "cosine", "fraction": 1.0, "end_factor": 0.05}],
    },
    "my_section": {"anything": 1},  # a user's own section is ignored
}


def test_lr_plot_writes_a_png_of_the_schedulers_values(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    output = tmp_path / "lr.png"
    assert main(["lr-plot", str(config), "-o", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    figure = plot_lr_schedule(lr_schedule_values(CONFIG), tmp_path / "again.png", title="t")
    steps, plotted = figure.axes[0].lines[0].get_data()
    schedule = PiecewiseSchedule(PiecewiseLRSchedulerConfig.model_validate(CONFIG["lr_scheduler"]), 300)
    assert len(plotted) == 300
    for step in (0, 1, 10, 19, 20, 21, 150, 298, 299):
        assert steps[step] == step
        assert plotted[step] == pytest.approx(0.01 * schedule(step), rel=1e-12)


def test_lr_plot_needs_steps_for_a_run_in_epochs(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "trainer": {"epochs": 2}}))
    assert main(["lr-plot", str(config), "-o", str(tmp_path / "lr.png")]) == 2
    assert main(["lr-plot", str(config), "-o", str(tmp_path / "lr.png"), "--steps", "40"]) == 0
