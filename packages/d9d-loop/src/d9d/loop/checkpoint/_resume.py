"""Resume from the newest usable checkpoint: pick the candidates, fall back past unusable ones, explain."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from d9d.loop.checkpoint._checkpointer import Checkpointer, CheckpointLocation
from d9d.loop.checkpoint._manifest import RunLayout
from d9d.loop.checkpoint._resume_attempt import ResumeAttempt, Resumed, Unusable
from d9d.loop.config._trainer import ResumeConfig


class NoUsableCheckpointError(RuntimeError):
    """Checkpoints exist but none can be loaded; lists each and why."""


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
    candidates = _candidates(checkpointer, logger=logger, older_than=older_than, from_step=from_step)
    attempt = ResumeAttempt(
        checkpointer=checkpointer,
        state=state,
        optional=optional,
        layout=layout,
        options=options,
        logger=logger,
        nonfinite_weights=nonfinite_weights,
    )
    return _fall_back(candidates, attempt)


def _fall_back(candidates: list[CheckpointLocation], attempt: ResumeAttempt) -> Resumed | None:
    """Tries the candidates newest first; once one loads, the unusable newer ones are set aside."""
    skipped: list[tuple[CheckpointLocation, str]] = []
    for location in candidates:
        match attempt.load(location):
            case Resumed() as resumed:
                if skipped:
                    moved = attempt.checkpointer.set_aside([loc for loc, _ in skipped])
                    attempt.logger.warning(
                        "resumed from %s; set aside the unusable newer checkpoints as %s",
                        location.path,
                        ", ".join(str(m) for m in moved),
                    )
                return resumed
            case Unusable(reason=reason):
                skipped.append((location, reason))
    if skipped:
        listing = "\n".join(f"  {loc.path}: {reason}" for loc, reason in skipped)
        raise NoUsableCheckpointError(f"no usable checkpoint to resume from:\n{listing}")
    return None


def _candidates(
    checkpointer: Checkpointer,
    *,
    logger: logging.LoggerAdapter[logging.Logger],
    older_than: int | None,
    from_step: int | None,
) -> list[CheckpointLocation]:
    """The checkpoints to try, newest first; with ``from_step`` only its own, the newer set aside."""
    candidates = checkpointer.candidates(older_than=older_than)
    if from_step is None:
        return candidates
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
    return candidates
