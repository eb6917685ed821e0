"""The estimate as a table, as one log line, and as a refusal naming what would make it fit."""

from __future__ import annotations

from d9d.loop.estimate._estimate import COMPONENTS, RankEstimate

GIB = float(1 << 30)


def _gib(value: int) -> str:
    return f"{value / GIB:.2f}"


def format_table(estimates: list[RankEstimate], *, device_bytes: int | None = None) -> str:
    """One column per pipeline rank, one row per component, in GiB; the total and its phase last."""
    names = [f"rank {e.pipeline_rank}" for e in estimates]
    label = max(len(name) for name in (*COMPONENTS, "allocated peak", "with allocator slack"))
    width = max(8, *(len(name) for name in names))
    lines = [f"{'GiB':<{label}}" + "".join(f"  {name:>{width}}" for name in names)]

    def row(name: str, values: list[int]) -> None:
        lines.append(f"{name:<{label}}" + "".join(f"  {_gib(v):>{width}}" for v in values))

    for component in COMPONENTS:
        row(component, [e.components[component] for e in estimates])
    row("allocated peak", [e.allocated for e in estimates])
    row("allocator slack", [e.slack for e in estimates])
    row("with allocator slack", [e.total for e in estimates])
    lines.append(f"{'peak falls in':<{label}}" + "".join(f"  {e.phase:>{width}}" for e in estimates))
    if len(estimates) > 1:
        lines.append("layers: " + ", ".join(f"rank {e.pipeline_rank}: {_layers(e)}" for e in estimates))
    if device_bytes is not None:
        lines.append(fit_line(estimates, device_bytes))
    return "\n".join(lines)


def _layers(estimate: RankEstimate) -> str:
    layers = estimate.layers
    return f"{layers.start}-{layers.stop - 1}" if len(layers) else "none"


def largest(estimates: list[RankEstimate]) -> RankEstimate:
    """The rank that needs the most (the first of equals)."""
    return max(estimates, key=lambda e: e.total)


def summary_line(estimates: list[RankEstimate]) -> str:
    """The configure-time line: the largest rank's peak, allocated and with slack, and its phase."""
    worst = largest(estimates)
    where = f"pipeline rank {worst.pipeline_rank}, " if len(estimates) > 1 else ""
    return (
        f"memory estimate: {_gib(worst.total)} GiB peak ({_gib(worst.allocated)} GiB allocated "
        f"+ {_gib(worst.slack)} GiB allocator slack; {where}{worst.phase})"
    )


def fit_line(estimates: list[RankEstimate], device_bytes: int) -> str:
    """Whether the largest rank fits ``device_bytes``, and the margin."""
    worst = largest(estimates)
    margin = device_bytes - worst.total
    verdict = f"fits, {_gib(margin)} GiB to spare" if margin >= 0 else f"over by {_gib(-margin)} GiB"
    return f"device: {_gib(device_bytes)} GiB: {verdict}"
