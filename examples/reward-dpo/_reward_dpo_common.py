"""What train_reward.py and train_dpo.py share: the pairs' settings, the tiny checkpoint, the run.

Named for this example: the scripts import it from their own folder, and other examples' modules
(their own ``toy_data``, ``train``) share ``sys.modules`` with it when tests import them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field
from toy_data import write_pairs, write_tiny_checkpoint

from d9d.hf import PretrainedModelConfig, resolve_snapshot
from d9d.loop import ConfigFileError, ExportTargetError, StepFinished, Trainer
from d9d.mesh import DistributedContext

_Config = TypeVar("_Config")


class PairsSection(BaseModel):
    """Where the pairs come from and where the run writes (each script's section adds its own).

    Attributes:
        work_dir: The generated tiny checkpoint and pairs live here.
        train: Training pairs: a JSONL of ``{prompt, chosen, rejected}`` (None: generated).
        held_out: Held-out pairs, evaluated during training (None: generated).
        generated_pairs: Pairs generated for training (and an eighth of that for held-out).
        sequence_length: Tokens of the longest prompt + answer kept.
        export_dir: The Hugging Face export. A previous export there is replaced; any other
            non-empty directory stops the run before training, unless ``replace_export_dir``.
        replace_export_dir: Replace ``export_dir`` even when it holds files d9d did not write.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    work_dir: Path = Path("runs/reward-dpo")
    train: Path | None = None
    held_out: Path | None = None
    generated_pairs: int = Field(default=1024, ge=8)
    sequence_length: int = Field(default=16, ge=4)
    export_dir: Path
    replace_export_dir: bool = False


def pair_files(section: PairsSection, seed: int) -> tuple[Path, Path]:
    """The training and held-out JSONL files (generated under ``work_dir`` when not given)."""
    train = section.train or section.work_dir / "pairs-train.jsonl"
    held_out = section.held_out or section.work_dir / "pairs-held-out.jsonl"
    if section.train is None and not train.exists():
        write_pairs(train, section.generated_pairs, seed=seed)
    if section.held_out is None and not held_out.exists():
        write_pairs(held_out, max(8, section.generated_pairs // 8), seed=seed + 1)
    return train, held_out


def tiny_checkpoint(work_dir: Path, seed: int) -> Path:
    """``work_dir/tiny-qwen3``: the generated tiny causal-LM Qwen3, written the first time."""
    checkpoint = work_dir / "tiny-qwen3"
    if not checkpoint.exists():
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_checkpoint(checkpoint, seed=seed)
    return checkpoint


def checkpoint_directory(model: PretrainedModelConfig, dist_context: DistributedContext) -> Path:
    """The checkpoint's local directory (downloaded once, by the main process first)."""
    with dist_context.main_process_first():
        return resolve_snapshot(model.source, revision=model.revision)


def eval_reporter(*names: str) -> Callable[[StepFinished], None]:
    """Prints ``names``' values after a step whose metrics hold them all (an evaluation step)."""

    def report(event: StepFinished) -> None:
        metrics = event.metrics
        if all(name in metrics for name in names):
            shown = " ".join(f"{name}={metrics[name]:.4f}" for name in names)
            print(f"eval after {event.step + 1} steps: {shown}", flush=True)

    return report


def train_and_export(
    trainer: Trainer,
    section: PairsSection,
    *,
    overwrite: bool,
    report: Callable[[StepFinished], None],
    exported: str,
) -> Path:
    """Trains (``report`` on the main process after each step), exports; returns the export directory.

    ``overwrite`` is ``check_export_target``'s answer; the main process prints ``exported``'s path.
    """
    with trainer:
        main = trainer.dist_context.is_main_process
        trainer.events.subscribe(StepFinished, lambda event: report(event) if main else None)
        trainer.train()
        replace = section.replace_export_dir
        export = trainer.export(section.export_dir, overwrite=overwrite, replace_other=replace)
    if main:
        print(f"exported {exported} to {export}")
    return export


def script_main(
    usage: str, load: Callable[[str], _Config], run: Callable[[_Config], Path], *, section: str
) -> None:
    """``SCRIPT CONFIG.yaml``: loads the config and runs it; exits 2 with the reason on a bad config.

    Args:
        usage: Printed (exit 2) for a wrong command line or ``-h``.
        load: Reads the config file (raising ``ConfigFileError``).
        run: Trains and exports (raising ``ExportTargetError`` for an export_dir it must not empty).
        section: The config section whose ``replace_export_dir`` overrides that refusal.
    """
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(usage, file=sys.stderr)
        sys.exit(2)
    try:
        config = load(sys.argv[1])
    except ConfigFileError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    try:
        run(config)
    except ExportTargetError as e:
        print(f"{e} ({section}.replace_export_dir: true)", file=sys.stderr)
        sys.exit(2)
