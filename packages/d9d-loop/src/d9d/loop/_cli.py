"""The ``d9d`` command: tools that read a job's config without starting it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from d9d.loop._lr_plot import lr_schedule_values, plot_lr_schedule


def main(argv: Sequence[str] | None = None) -> int:
    """``d9d lr-plot CONFIG.yaml -o lr.png [--steps N]``: draws the configured LR schedule."""
    parser = argparse.ArgumentParser(prog="d9d")
    commands = parser.add_subparsers(dest="command", required=True)
    lr_plot = commands.add_parser("lr-plot", help="draw the learning-rate schedule of a config")
    lr_plot.add_argument("config", type=Path)
    lr_plot.add_argument("-o", "--output", type=Path, default=Path("lr.png"))
    lr_plot.add_argument("--steps", type=int, default=None, help="run length when the config uses epochs")
    args = parser.parse_args(argv)
    match args.command:
        case "lr-plot":
            raw: Any = yaml.safe_load(args.config.read_text())
            try:
                values = lr_schedule_values(raw, steps=args.steps)
            except ValueError as e:
                print(f"d9d lr-plot: {args.config}: {e}", file=sys.stderr)
                return 2
            plot_lr_schedule(values, args.output, title=str(args.config))
            print(f"wrote {args.output} ({len(values)} steps, lr {min(values):.3g} to {max(values):.3g})")
            return 0
        case _:
            return 2


if __name__ == "__main__":
    sys.exit(main())
