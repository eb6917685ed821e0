"""The step in flight: when its figures are read, what the guard and evaluation say, who hears of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from d9d.loop._events import EventBus, ForwardBackwardFinished, OptimizerStepFinished, StepFinished
from d9d.loop.config._run_plan import RunPlan
from d9d.loop.evaluation._evaluation import Evaluator
from d9d.loop.metrics import MetricSet
from d9d.loop.observability._progress import ProgressBar
from d9d.loop.observability._run_instruments import RunInstruments
from d9d.loop.observability._step_metrics import StepEnd, StepWork
from d9d.loop.observability._trackers import Tracker
from d9d.loop.step._executor import StepInFlight
from d9d.loop.step._figures import StepFigures
from d9d.loop.step._nonfinite_guard import NonFiniteGuard, StepVerdict
from d9d.mesh import DistributedContext

# How long a failing step waits for the previous step's figures before giving up on them.
_FAILURE_REPORT_WAIT_S = 30.0


@dataclass(kw_only=True, frozen=True)
class StepReport:
    """What reading the figures of zero, one or two steps found; the caller acts on it.

    Attributes:
        metrics: Each reported step's metrics, oldest first.
        rollback_due: A reported step was not finite and ``rollback`` is the policy: nothing of
            the state after it may be saved, and the run goes back to a checkpoint.
        evaluation_improved: An evaluation of a reported step found a new best.
    """

    metrics: tuple[dict[str, float], ...] = ()
    rollback_due: bool = False
    evaluation_improved: bool = False

    def then(self, later: StepReport) -> StepReport:
        """This report followed by ``later`` (the next step's)."""
        return StepReport(
            metrics=self.metrics + later.metrics,
            rollback_due=self.rollback_due or later.rollback_due,
            evaluation_improved=self.evaluation_improved or later.evaluation_improved,
        )


@dataclass(kw_only=True)
class StepReporter:
    """Owns the step whose figures are not read yet, and reports each step once.

    Under ``read_figures: during_next_step`` a step's figures are read while the next step's
    forward and backward keep the device busy, unless something must see them at the step's end
    (a checkpoint, an evaluation, logged training metrics, the run's last step). Reporting a step
    means: reading its figures, the non-finite guard's verdict, ``ForwardBackwardFinished``,
    ``OptimizerStepFinished``, training metrics, evaluation, the tracker, ``StepFinished``. The
    verdict is returned in a ``StepReport``; the progress bar shows what was reported.
    """

    dist_context: DistributedContext
    plan: RunPlan
    events: EventBus
    guard: NonFiniteGuard
    instruments: RunInstruments
    tracker: Tracker
    train_metrics: MetricSet | None
    evaluator: Evaluator | None
    checkpoint_due: Callable[[int], bool]  # whether a checkpoint falls due after N finished steps
    _in_flight: StepInFlight | None = field(default=None, init=False)
    _reporting_late: bool = field(default=False, init=False)
    _bar: ProgressBar | None = field(default=None, init=False)

    def refuse_while_late(self, call: str, *, step: int) -> None:
        """Refuses ``call`` from an event of a step reported in the middle of step ``step``.

        Raises:
            RuntimeError: If a step's events are being published during the next step (its work
                is queued then), naming both steps.
        """
        if self._reporting_late:
            raise RuntimeError(
                f"{call} was called during step {step} (from an event of step {step - 1}, whose figures "
                "are read during the next step under trainer.logging.read_figures=during_next_step); "
                "call it between steps"
            )

    def report_previous(self) -> StepReport:
        """Reports the step in flight, if any (called once the next step's work is queued)."""
        if self._in_flight is None:
            return StepReport()
        self._reporting_late = True
        try:
            return self._report(self._in_flight)
        finally:
            self._reporting_late = False
            self._in_flight = None

    def finish(self, in_flight: StepInFlight) -> StepReport:
        """Reports a step at its end, or keeps it in flight for the next step to report."""
        step = in_flight.figures.step
        if self._reads_at_end(step):
            return self._report(in_flight)  # the step's time includes the wait
        self._in_flight = replace(in_flight, ended=self._end_step(step))
        return StepReport()

    def report_before_failing(self, failed_step: int) -> None:
        """Reports the step whose figures were still in flight when ``failed_step`` failed.

        Its loss and metrics are often what explains the failure. The device may never finish
        (a hung collective), so the wait is bounded, and an error of the report itself is logged
        without replacing the step's own.
        """
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None or not in_flight.figures.wait(_FAILURE_REPORT_WAIT_S):
            return
        try:
            self._report(in_flight)
        except Exception as e:
            self.dist_context.logger.warning(
                "step %d's figures could not be reported after step %d failed: %s: %s",
                in_flight.figures.step, failed_step, type(e).__name__, e,
            )  # fmt: skip

    def open_progress(self, *, initial: int) -> None:
        """Shows a progress bar from ``initial`` steps (main rank, when the plan wants one)."""
        self._bar = ProgressBar(
            total=self.plan.total_steps,
            initial=initial,
            enabled=self.plan.progress_bar and self.dist_context.is_main_process,
        )

    def show(self, report: StepReport) -> None:
        """Advances the progress bar by the reported steps, showing their metrics."""
        if self._bar is not None:
            for metrics in report.metrics:
                self._bar.update(metrics)

    def close(self) -> None:
        """Closes the progress bar."""
        if self._bar is not None:
            self._bar.close()

    def _reads_at_end(self, step: int) -> bool:
        """Whether ``step``'s figures are read at its end rather than during the next step."""
        match self.plan.read_figures:
            case "after_step":
                return True
            case "during_next_step":
                done = step + 1
                evaluation_due = self.evaluator is not None and self.evaluator.is_due(done)
                metrics_logged = self.train_metrics is not None and self.plan.logs_metrics(step)
                return (
                    done == self.plan.total_steps
                    or self.checkpoint_due(done)
                    or evaluation_due
                    or metrics_logged
                )

    def _end_step(self, step: int) -> StepEnd:
        self.instruments.lap("optimizer")
        return self.instruments.step_finished(step)

    def _read(self, in_flight: StepInFlight) -> tuple[StepFigures, StepVerdict]:
        """The step's figures and the guard's verdict on them (read before the optimizer step or now)."""
        if in_flight.read_before is not None:
            return in_flight.read_before, in_flight.verdict_before
        step = in_flight.figures.step
        figures = in_flight.figures.read()
        self.events.publish(ForwardBackwardFinished(step=step, loss=figures.loss))
        # A step that was not finite already went through the optimizer here: `stop` ends the
        # run and `rollback` reloads a checkpoint, so no state after it is ever saved.
        return figures, self.guard.check(step=step, loss=figures.loss, grad_norm=figures.grad_norm)

    def _report(self, in_flight: StepInFlight) -> StepReport:
        """Reads a step's figures, checks them, publishes its events and logs its metrics."""
        step = in_flight.figures.step
        figures, verdict = self._read(in_flight)
        ended = in_flight.ended if in_flight.ended is not None else self._end_step(step)
        self.events.publish(
            OptimizerStepFinished(
                step=step, learning_rate=in_flight.learning_rate, grad_norm=figures.grad_norm
            )
        )
        metrics = self._step_metrics(in_flight, figures, verdict, ended)
        logged = self.plan.logs_metrics(step)
        if self.train_metrics is not None and logged:  # collective: every rank logs the same steps
            metrics |= self.train_metrics.compute(self.dist_context.world_group())
        improved = False
        if self.evaluator is not None and self.evaluator.is_due(step + 1):
            evaluation = self.evaluator.evaluate(step=step + 1)
            metrics |= evaluation.metrics
            improved, logged = evaluation.improved, True
        if self.dist_context.is_main_process and logged:
            self.tracker.log(step, metrics)
        self.events.publish(StepFinished(step=step, metrics=metrics))
        return StepReport(
            metrics=(metrics,), rollback_due=verdict is StepVerdict.ROLLBACK, evaluation_improved=improved
        )

    def _step_metrics(
        self, in_flight: StepInFlight, figures: StepFigures, verdict: StepVerdict, ended: StepEnd
    ) -> dict[str, float]:
        """Loss, learning rate, norm, the instruments' figures and the task's per-step metrics."""
        metrics: dict[str, float] = {
            "loss": figures.loss,
            "lr": in_flight.learning_rate,
            "grad_norm": figures.grad_norm,
        }
        if verdict is StepVerdict.SKIP:
            metrics["skipped"] = 1.0
        # throughput (smoothed), step-time split, MFU, memory
        metrics |= self.instruments.figures(
            ended, StepWork(samples=self.plan.batch.global_batch_size, tokens=figures.tokens)
        )
        for name, value in zip(in_flight.metric_names, figures.metric_sums, strict=True):
            metrics[name] = value / figures.microbatches
        return metrics
