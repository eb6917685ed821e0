"""The NCCL settings d9d defaults before it starts NCCL process groups, so a hung job ends promptly.

torch's ``ProcessGroupNCCL`` reads these from the environment when a group is constructed. What
its watchdog thread does with a collective that passed the group's timeout (torch 2.11): it logs
the collective, signals every rank to dump its flight recorder, sleeps
``4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (60 s at torch's default of 15 000 ms) to give the
dumps time, then, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, aborts the communicators and
rethrows from its own thread, which ends the process. That sleep is why a job whose timeout was
5 s ended after 79 s. A local flight-recorder dump takes milliseconds, so d9d shortens the wait.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

NCCL_ERROR_HANDLING_ENV_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""torch's switch for what a failed NCCL collective does; d9d defaults it to 1 (tear down)."""

NCCL_DUMP_WAIT_ENV_VAR = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
"""How long torch waits for a flight-recorder dump; its watchdog sleeps 4x this after a timeout."""

NCCL_ENVIRONMENT_DEFAULTS: Mapping[str, str] = {
    # Tear the process down on a failed or timed-out collective: otherwise the wait on it can
    # return after the watchdog's abort, leaving wrong values in the step.
    NCCL_ERROR_HANDLING_ENV_VAR: "1",
    # 1 s per dump attempt: the watchdog ends the process 4 s after it caught the timeout.
    NCCL_DUMP_WAIT_ENV_VAR: "1000",
}
"""What d9d sets for NCCL groups unless the user already set it (their value wins)."""


def apply_nccl_defaults(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Sets every ``NCCL_ENVIRONMENT_DEFAULTS`` entry that ``environ`` lacks.

    Call it before the NCCL process groups are created: torch reads the values when it
    constructs a group, so a group that already exists keeps what it read.

    Args:
        environ: The environment to complete (``os.environ`` in a job).

    Returns:
        The entries this call set (empty when the user had set them all).
    """
    applied: dict[str, str] = {}
    for name, value in NCCL_ENVIRONMENT_DEFAULTS.items():
        if name not in environ:
            environ[name] = value
            applied[name] = value
    return applied
