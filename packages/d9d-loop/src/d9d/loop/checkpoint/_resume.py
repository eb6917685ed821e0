"""Resume from the newest usable checkpoint: verify, check compatibility, fall back, explain."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from d9d.loop.checkpoint._checkpointer import Checkpointer, CheckpointLoadError, CheckpointLocation
from d9d.loop.checkpoint._finite_weights import describe_nonfinite
from d9d.loop.checkpoint._manifest import ManifestError, RunLayout
from d9d.loop.config._trainer import ResumeConfig


class ResumeIncompatibleError(ValueError):
    """The checkpoint was written by a run this one cannot continue; names both values."""


class NoUsableCheckpointError(RuntimeError):
    """Checkpoints exist but none can be loaded; lists each and why."""


@dataclass(kw_only=True, frozen=True)
class Resumed:
    """The checkpoint a run resumed from, the optional state keys it lacked, and dtypes it cast.

    Attributes:
        location: The checkpoint loaded.
        absent: Optional top-level keys it did not hold.
        cast: One line per model-tensor dtype change (checkpoint dtype, run dtype), for the
            trainer's "the config wins" lines.
    """

    location: CheckpointLocation
    absent: list[str]
    cast: list[str] = field(default_factory=list[str])


def check_layout(saved: RunLayout, current: RunLayout, options: ResumeConfig, where: str) -> bool:
    """Whether to load the optimizer state; raises if the run cannot continue the checkpoint.

    A different global batch is allowed here: the data source converts its position in samples
    (and refuses where that is impossible). A different optimizer is refused unless
    ``resume.optimizer_state`` is ``reset``.
    """
    match options.optimizer_state:
        case "reset":
            return False
        case "load":
            if saved.optimizer != current.optimizer:
                raise ResumeIncompatibleError(
                    f"{where} holds the state of optimizer {saved.optimizer}, this run uses "
                    f"{current.optimizer}; set trainer.checkpoint.resume: {{optimizer_state: reset}} "
                    f"to start the optimizer afresh"
                )
            return True


_LISTED = 8
SUPERSEDED_SUFFIX = ".superseded"


def describe_missing_step(step: int, on_disk: list[CheckpointLocation]) -> str:
    """Why ``resume.from_step`` cannot be honoured: the steps there are instead."""
    steps = ", ".join(str(c.step) for c in on_disk) or "none"
    where = on_disk[0].path.parent if on_disk else "the checkpoint directory"
    return (
        f"trainer.checkpoint.resume.from_step={step}: there is no complete checkpoint of step {step} "
        f"in {where} (complete checkpoints there: {steps}); pick one of them, or remove from_step "
        "to resume from the newest"
    )


def older_checkpoint_hint(resumed: CheckpointLocation | None, on_disk: list[CheckpointLocation]) -> str:
    """How to resume from an older checkpoint after a run failed (empty without checkpoints)."""
    if not on_disk:
        return ""
    start = (
        f"this run resumed from {resumed.path}"
        if resumed is not None
        else f"the newest checkpoint is {on_disk[-1].path}"
    )
    reference = resumed if resumed is not None else on_disk[-1]
    older = [c.step for c in on_disk if c.step < reference.step]
    steps = ", ".join(str(c.step) for c in on_disk)
    pick = (
        f"resume from an older one with trainer.checkpoint.resume: {{from_step: {older[-1]}}}"
        if older
        else "there is no older checkpoint to resume from: start afresh in another directory"
    )
    return (
        f"{start}; if its weights diverged already (finite but huge), {pick} (complete checkpoints: {steps})"
    )


def _describe_shapes(where: str, mismatched: list[str]) -> str:
    listed = "\n".join(f"  {m}" for m in mismatched[:_LISTED])
    more = f"\n  ... and {len(mismatched) - _LISTED} more" if len(mismatched) > _LISTED else ""
    return (
        f"{where} was written by another model ({len(mismatched)} tensors differ):\n{listed}{more}\n"
        f"resume with the model that wrote it, or point trainer.checkpoint.directory elsewhere"
    )


def _explain_nonfinite(checkpointer: Checkpointer, location: CheckpointLocation, found: list[str]) -> str:
    """Why a checkpoint holds NaN or infinite weights: damaged on disk, or saved so (collective)."""
    what = f"holds non-finite weights ({describe_nonfinite(found)})"
    match checkpointer.verify_mode:
        case "sizes":
            damage = checkpointer.verify(location, mode="checksums")
            if damage:
                return (
                    f"{what}: its files changed after it was written ({damage[0]}); "
                    f"trainer.checkpoint.verify: checksums finds such damage before loading"
                )
        case "checksums":
            pass
    return f"{what}: it was saved so (its files match their manifest)"


def load_newest_usable(
    checkpointer: Checkpointer,
    *,
    state: Callable[[bool], dict[str, Any]],
    optional: tuple[str, ...],
    layout: RunLayout,
    options: ResumeConfig,
    logger: logging.LoggerAdapter[logging.Logger],
    nonfinite_weights: Callable[[], list[str]],
    older_than: int | None = None,
    from_step: int | None = None,
) -> Resumed | None:
    """Loads the newest checkpoint that verifies and loads; falls back to older ones (collective).

    A checkpoint whose files disagree with its manifest, whose load fails, or whose weights are
    not finite once loaded, is skipped with a warning naming the file (or tensor) and the reason;
    once an older one loads, the skipped newer ones are renamed ``step_N.damaged``.
    Incompatibility (another optimizer, other shapes) is not damage: it raises.

    Args:
        checkpointer: Where the checkpoints are.
        state: Builds what to restore; its argument says whether to include the optimizer.
        optional: Top-level keys that may be absent.
        layout: This run's layout, compared with each checkpoint's.
        options: The resume settings.
        logger: Receives one warning per skipped checkpoint.
        nonfinite_weights: The parameters holding NaN or infinity after a load (collective).
        older_than: Only checkpoints of fewer steps (a repeated rollback moves back).
        from_step: Only the checkpoint of this step (``resume.from_step``); the newer ones are
            set aside as ``step_N.superseded``, so a later restart never picks them.

    Returns:
        The checkpoint loaded, or None when there is none at all.

    Raises:
        ValueError: If there is no checkpoint of ``from_step``, listing those there are.
        NoUsableCheckpointError: If checkpoints exist but none is usable, listing each and why.
        ResumeIncompatibleError: If the newest intact checkpoint belongs to an incompatible run
            (another optimizer, or tensors of other shapes: each named with both shapes).
    """
    skipped: list[tuple[CheckpointLocation, str]] = []
    candidates = checkpointer.candidates(older_than=older_than)
    if from_step is not None:
        newer = [c for c in candidates if c.step > from_step]
        candidates = [c for c in candidates if c.step == from_step]
        if not candidates:
            raise ValueError(describe_missing_step(from_step, checkpointer.on_disk()))
        if newer:
            moved = checkpointer.set_aside(newer, suffix=SUPERSEDED_SUFFIX)
            logger.warning(
                "resuming from the checkpoint of step %d (trainer.checkpoint.resume.from_step); "
                "set aside the newer %s",
                from_step,
                ", ".join(str(m) for m in moved),
            )
    for location in candidates:
        problems = checkpointer.verify(location)
        if problems:
            reason = "; ".join(problems)
            logger.warning("checkpoint %s is damaged, trying an older one: %s", location.path, reason)
            skipped.append((location, reason))
            continue
        try:
            manifest = checkpointer.manifest(location)
        except ManifestError as e:
            skipped.append((location, str(e)))
            continue
        with_optimizer = True
        if manifest is None:
            logger.warning(
                "checkpoint %s has no manifest (an older d9d wrote it): not verified", location.path
            )
        else:
            with_optimizer = check_layout(manifest.layout, layout, options, str(location.path))
        wanted = state(with_optimizer)
        mismatched = checkpointer.shape_mismatches(location, wanted)
        if mismatched:
            raise ResumeIncompatibleError(_describe_shapes(str(location.path), mismatched))
        cast = checkpointer.dtype_changes(location, wanted)
        try:
            absent = checkpointer.load(location, wanted, optional=optional)
        except CheckpointLoadError as e:
            logger.warning("checkpoint %s failed to load, trying an older one: %s", location.path, e)
            skipped.append((location, str(e)))
            continue
        nonfinite = nonfinite_weights()
        if nonfinite:
            reason = _explain_nonfinite(checkpointer, location, nonfinite)
            logger.warning("checkpoint %s %s; trying an older one", location.path, reason)
            skipped.append((location, reason))
            continue
        if skipped:
            moved = checkpointer.set_aside([loc for loc, _ in skipped])
            logger.warning(
                "resumed from %s; set aside the unusable newer checkpoints as %s",
                location.path,
                ", ".join(str(m) for m in moved),
            )
        return Resumed(location=location, absent=absent, cast=cast)
    if skipped:
        listing = "\n".join(f"  {loc.path}: {reason}" for loc, reason in skipped)
        raise NoUsableCheckpointError(f"no usable checkpoint to resume from:\n{listing}")
    return None
