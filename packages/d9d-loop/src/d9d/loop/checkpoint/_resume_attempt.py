"""Tries one checkpoint for a resume: verify, check compatibility, load, check the weights are finite."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from d9d.loop.checkpoint._checkpointer import Checkpointer, CheckpointLoadError, CheckpointLocation
from d9d.loop.checkpoint._finite_weights import describe_nonfinite
from d9d.loop.checkpoint._manifest import Manifest, ManifestError, RunLayout
from d9d.loop.config._trainer import ResumeConfig

_LISTED = 8


class ResumeIncompatibleError(ValueError):
    """The checkpoint was written by a run this one cannot continue; names both values."""


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


@dataclass(frozen=True)
class Unusable:
    """Why a checkpoint was skipped (damaged, failed to load, non-finite weights)."""

    reason: str


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


@dataclass(kw_only=True, frozen=True)
class ResumeAttempt:
    """Loads one checkpoint into this run's state, or says why it is unusable (collective).

    Attributes:
        checkpointer: Where the checkpoints are.
        state: Builds what to restore; its argument says whether to include the optimizer.
        optional: Top-level keys that may be absent.
        layout: This run's layout, compared with the checkpoint's.
        options: The resume settings.
        logger: Receives a warning per unusable checkpoint (and per one without a manifest).
        nonfinite_weights: The parameters holding NaN or infinity after a load (collective).
    """

    checkpointer: Checkpointer
    state: Callable[[bool], dict[str, Any]]
    optional: tuple[str, ...]
    layout: RunLayout
    options: ResumeConfig
    logger: logging.LoggerAdapter[logging.Logger]
    nonfinite_weights: Callable[[], list[str]]

    def load(self, location: CheckpointLocation) -> Resumed | Unusable:
        """Loads ``location``: what it restored, or why an older one should be tried.

        Raises:
            ResumeIncompatibleError: If an intact checkpoint belongs to an incompatible run
                (another optimizer, or tensors of other shapes).
        """
        problems = self.checkpointer.verify(location)
        if problems:
            reason = "; ".join(problems)
            self.logger.warning("checkpoint %s is damaged, trying an older one: %s", location.path, reason)
            return Unusable(reason)
        try:
            manifest = self.checkpointer.manifest(location)
        except ManifestError as e:
            return Unusable(str(e))
        wanted = self.state(self._with_optimizer(location, manifest))
        mismatched = self.checkpointer.shape_mismatches(location, wanted)
        if mismatched:
            raise ResumeIncompatibleError(_describe_shapes(str(location.path), mismatched))
        cast = self.checkpointer.dtype_changes(location, wanted)
        try:
            absent = self.checkpointer.load(location, wanted, optional=self.optional)
        except CheckpointLoadError as e:
            self.logger.warning("checkpoint %s failed to load, trying an older one: %s", location.path, e)
            return Unusable(str(e))
        nonfinite = self.nonfinite_weights()
        if nonfinite:
            reason = _explain_nonfinite(self.checkpointer, location, nonfinite)
            self.logger.warning("checkpoint %s %s; trying an older one", location.path, reason)
            return Unusable(reason)
        return Resumed(location=location, absent=absent, cast=cast)

    def _with_optimizer(self, location: CheckpointLocation, manifest: Manifest | None) -> bool:
        """Whether the optimizer state is wanted; a checkpoint without a manifest is not checked."""
        if manifest is None:
            self.logger.warning(
                "checkpoint %s has no manifest (an older d9d wrote it): not verified", location.path
            )
            return True
        return check_layout(manifest.layout, self.layout, self.options, str(location.path))


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
