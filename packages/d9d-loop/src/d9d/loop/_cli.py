"""The ``d9d`` command: tools around a job that do not start it.

``lr-plot`` (the configured LR schedule), ``plot`` (a run's metrics), ``inspect`` (a checkpoint
or an export), ``export`` (a DCP checkpoint to a Hugging Face directory). Bad input ends with
exit status 2 and one line naming the file; only ``export`` imports a model provider (d9d-hf's
by default), and only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from d9d.loop.cli._errors import CommandError, read_yaml_mapping


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="d9d",
        description="Tools around a d9d job that do not start it "
        "(bad input: exit status 2 and a line naming the file).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    lr_plot = commands.add_parser("lr-plot", help="draw the learning-rate schedule of a config")
    lr_plot.add_argument("config", type=Path, help="the job's YAML config")
    lr_plot.add_argument(
        "-o", "--output", type=Path, default=Path("lr.png"), help="PNG, SVG or PDF (by suffix)"
    )
    lr_plot.add_argument("--steps", type=int, default=None, help="run length when the config uses epochs")

    plot = commands.add_parser("plot", help="draw loss, lr and throughput of a run's JSONL metrics")
    plot.add_argument("metrics", type=Path, help="the jsonl tracker's file (trainer.logging.tracker)")
    plot.add_argument("-o", "--output", type=Path, default=Path("metrics.png"), help="PNG, SVG or PDF")

    inspect = commands.add_parser("inspect", help="list what a DCP checkpoint or safetensors export holds")
    inspect.add_argument(
        "path", type=Path, help="a checkpoint step directory, a safetensors file or directory"
    )

    export = commands.add_parser(
        "export",
        help="turn a DCP training checkpoint into a Hugging Face directory (one CPU process, offline)",
        description="Builds the model of CONFIG on one CPU process, loads CHECKPOINT_DIR (saved under "
        "any layout) and writes OUT_DIR as safetensors plus the provider's files (config.json, "
        "tokenizer). LoRA adapters are merged as trainer.peft says.",
    )
    export.add_argument("config", type=Path, help="the job's YAML config (its model and trainer sections)")
    export.add_argument("checkpoint", type=Path, help="a step_* checkpoint, or the directory holding them")
    export.add_argument("output", type=Path, help="the directory to write")
    export.add_argument(
        "--provider",
        default=None,
        help="module:function building your ModelProvider from the config mapping "
        "(default: d9d.hf:provider_from_config, from the config's model section)",
    )
    export.add_argument("--force", action="store_true", help="replace OUT_DIR even if it is not a d9d export")
    return parser


def _lr_plot(args: argparse.Namespace) -> str:
    from d9d.loop._lr_plot import lr_schedule_values, plot_lr_schedule

    raw = read_yaml_mapping(args.config)
    try:
        values = lr_schedule_values(raw, steps=args.steps)
    except (ValueError, TypeError, AttributeError) as e:
        raise CommandError(f"{args.config}: {e}") from e
    plot_lr_schedule(values, args.output, title=str(args.config))
    return f"wrote {args.output} ({len(values)} steps, lr {min(values):.3g} to {max(values):.3g})"


def _plot(args: argparse.Namespace) -> str:
    from d9d.loop.cli._metrics_plot import plot_metrics, read_metrics

    rows = read_metrics(args.metrics)
    drawn = plot_metrics(rows, args.output, title=str(args.metrics))
    return f"wrote {args.output} ({len(rows)} rows: {', '.join(drawn)})"


def _inspect(args: argparse.Namespace) -> str:
    from d9d.loop.cli._inspect import format_inspection, inspect_path

    return format_inspection(inspect_path(args.path))


def _export(args: argparse.Namespace) -> str:
    from d9d.loop.cli._checkpoint_export import (
        DEFAULT_PROVIDER,
        export_checkpoint,
        load_provider_function,
        resolve_checkpoint,
    )

    config = read_yaml_mapping(args.config)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; returns 0, or 2 on bad input (the message on stderr names the file)."""
    args = _parser().parse_args(argv)
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
            case _:
                raise CommandError(f"unknown command {command}")
    except CommandError as e:
        print(f"d9d {command}: {e}", file=sys.stderr)
        return 2
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
