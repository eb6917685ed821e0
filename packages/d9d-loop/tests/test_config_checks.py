"""Configs that used to be accepted without a word are refused at load, naming the key or file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from d9d.loop import ConfigFileError, ProjectConfig, ResumeConfig

BASE: dict[str, Any] = {"trainer": {"max_steps": 10, "global_batch_size": 8, "microbatch_size": 2}}


def _with(section: str, value: dict[str, Any]) -> dict[str, Any]:
    return {**BASE, section: value}


def _trainer(**extra: Any) -> dict[str, Any]:
    return {"trainer": {**BASE["trainer"], **extra}}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        # warm-up with both lengths: the fraction used to be ignored
        (
            _with("lr_scheduler", {"name": "piecewise", "warmup": {"steps": 2, "fraction": 0.1}}),
            r"warmup\n.*both 'steps' \(2\) and 'fraction' \(0.1\)",
        ),
        # a warm-up longer than the run (max_steps=10)
        (
            _with("lr_scheduler", {"name": "piecewise", "warmup": {"steps": 50}}),
            r"lr_scheduler.warmup.steps=50 is longer than the run \(10 steps\)",
        ),
        # phases whose fractions of the run sum to 3
        (
            _with(
                "lr_scheduler",
                {
                    "name": "piecewise",
                    "phases": [{"kind": k, "fraction": 1.0} for k in ("constant", "linear", "cosine")],
                },
            ),
            r"lr_scheduler.piecewise\n.*phases: the fractions of the run .* sum to 3",
        ),
        # fractions that leave part of the run without a phase
        (
            _with("lr_scheduler", {"name": "piecewise", "phases": [{"kind": "constant", "fraction": 0.5}]}),
            r"sum to 0.5; they must sum to 1",
        ),
        # Adam's betas must lie in [0, 1)
        (
            _with("optimizer", {"name": "adamw", "betas": [1.5, 0.9]}),
            r"optimizer.adamw.betas\n.*betas\[0\]=1.5",
        ),
        (
            _with("optimizer", {"name": "adam", "betas": [0.9, 1.0]}),
            r"optimizer.adam.betas\n.*betas\[1\]=1.0",
        ),
        # an empty checkpoint directory used to mean the working directory
        (_trainer(checkpoint={"directory": ""}), r"trainer.checkpoint.directory\n.*an empty path"),
        (_trainer(initialization={"source": " "}), r"trainer.initialization.source\n.*an empty path"),
        (
            _trainer(logging={"tracker": {"name": "jsonl", "path": ""}}),
            r"trainer.logging.tracker.jsonl.path\n.*an empty path",
        ),
        # the resume options are a closed set
        (_trainer(checkpoint={"resume": {"optimizer_state": "keep"}}), r"trainer.checkpoint.resume"),
        # the non-finite policies are a discriminated union
        (_trainer(nonfinite={"policy": "ignore"}), r"trainer.nonfinite"),
    ],
)
def test_bad_config_is_refused_naming_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=f"(?s){message}"):
        ProjectConfig.model_validate(raw)


def test_warmup_fraction_with_default_phases_fills_the_rest_of_the_run() -> None:
    config = ProjectConfig.model_validate(
        _with("lr_scheduler", {"name": "piecewise", "warmup": {"fraction": 0.1}})
    )
    assert config.lr_scheduler.name == "piecewise"
    assert [p.fraction for p in config.lr_scheduler.phases] == [pytest.approx(0.9)]


def test_resume_accepts_a_bool_or_options() -> None:
    # `resume: true|false` keeps working; options are the new spelling
    on = ProjectConfig.model_validate(_trainer(checkpoint={"resume": True}))
    off = ProjectConfig.model_validate(_trainer(checkpoint={"resume": False}))
    reset = ProjectConfig.model_validate(_trainer(checkpoint={"resume": {"optimizer_state": "reset"}}))
    assert on.trainer.checkpoint.resume_options == ResumeConfig()
    assert off.trainer.checkpoint.resume_options is None
    assert reset.trainer.checkpoint.resume_options == ResumeConfig(optimizer_state="reset")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is empty"),  # an empty file
        ("trainer: [\n", "is not valid YAML"),  # a YAML syntax error
        ("- 1\n- 2\n", "must be a mapping"),  # YAML, but not sections
        ("trainer: {max_steps: 2}\n", "invalid config"),  # does not validate
    ],
)
def test_config_file_errors_name_the_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(content)
    with pytest.raises(ConfigFileError, match=message) as error:
        ProjectConfig.from_yaml(path)
    assert str(path) in str(error.value)


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match=f"cannot read config {tmp_path / 'nope.yaml'}"):
        ProjectConfig.from_yaml(tmp_path / "nope.yaml")
