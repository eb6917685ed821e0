"""The ``d9d`` subcommands once their arguments parsed: each checks its input, then works.

Bad input raises ``CommandError`` before any work; ``run_command`` prints it as one line on
stderr and returns exit status 2. Heavy modules (the plotting library, the checkpoint reader,
the model provider) are imported inside the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import sys

from d9d.loop.cli._errors import CommandError, check_output_file, read_yaml_mapping

PICTURE_SUFFIXES = (".png", ".svg", ".pdf")
"""What ``lr-plot`` and ``plot`` write, picked by the output's suffix."""


def _lr_plot(args: argparse.Namespace) -> str:
    check_output_file(args.output, PICTURE_SUFFIXES)
    raw = read_yaml_mapping(args.config)
    from d9d.loop._lr_plot import lr_schedule_values, plot_lr_schedule

    try:
        values = lr_schedule_values(raw, steps=args.steps)
    except (ValueError, TypeError, AttributeError) as e:
        raise CommandError(f"{args.config}: {e}") from e
    try:
        plot_lr_schedule(values, args.output, title=str(args.config))
    except OSError as e:
        raise CommandError(f"cannot write {args.output}: {e.strerror or e}") from e
    return f"wrote {args.output} ({len(values)} steps, lr {min(values):.3g} to {max(values):.3g})"


def _plot(args: argparse.Namespace) -> str:
    check_output_file(args.output, PICTURE_SUFFIXES)
    from d9d.loop.cli._metrics_plot import plot_metrics, read_metrics

    rows = read_metrics(args.metrics)
    try:
        drawn = plot_metrics(rows, args.output, title=str(args.metrics))
    except OSError as e:
        raise CommandError(f"cannot write {args.output}: {e.strerror or e}") from e
    return f"wrote {args.output} ({len(rows)} rows: {', '.join(drawn)})"


def _inspect(args: argparse.Namespace) -> str:
    from d9d.loop.cli._inspect import format_inspection, inspect_path

    return format_inspection(inspect_path(args.path))


def _export(args: argparse.Namespace) -> str:
    if not args.output.parent.is_dir():
        raise CommandError(f"cannot write {args.output}: its folder {args.output.parent} does not exist")
    config = read_yaml_mapping(args.config)
    from d9d.loop.cli._checkpoint_export import (
        DEFAULT_PROVIDER,
        export_checkpoint,
        load_provider_function,
        resolve_checkpoint,
    )

    checkpoint = resolve_checkpoint(args.checkpoint)
    provider_function = load_provider_function(args.provider or DEFAULT_PROVIDER)
    target = export_checkpoint(
        config=config,
        config_path=args.config,
        checkpoint=checkpoint,
        target=args.output,
        provider_function=provider_function,
        replace_other=args.force,
    )
    return f"exported {checkpoint} to {target}"


def _estimate(args: argparse.Namespace) -> str:
    config = read_yaml_mapping(args.config)
    from d9d.loop.cli._estimate import estimate_command, read_memory_job

    job = read_memory_job(config, args.config, seq_len=args.seq_len, provider=args.provider)
    return estimate_command(job, device_gib=args.device_memory)


def run_command(args: argparse.Namespace) -> int:
    """Runs the parsed subcommand; returns 0, or 2 on bad input (one line on stderr names the file)."""
    command: str = args.command
    try:
        match command:
            case "lr-plot":
                message = _lr_plot(args)
            case "plot":
                message = _plot(args)
            case "inspect":
                message = _inspect(args)
            case "export":
                message = _export(args)
            case "estimate":
                message = _estimate(args)
            case _:
                raise CommandError(f"unknown command {command}")
    except CommandError as e:
        print(f"d9d {command}: {e}", file=sys.stderr)
        return 2
    print(message)
    return 0
