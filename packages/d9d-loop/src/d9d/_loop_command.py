"""The ``d9d`` command's entry point: its arguments and ``--help``, without importing torch.

It lives beside ``d9d.loop``, not inside it: importing anything under ``d9d.loop`` runs the
package's ``__init__``, which imports torch (seconds). Here only the standard library is
imported; each subcommand imports what it needs (``d9d.loop.cli._commands``) once its arguments
have parsed, so ``d9d --help`` and every subcommand's ``--help`` answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_TRUSTED = (
    "A DCP checkpoint is trusted input: its .metadata is a Python pickle that torch reads, and "
    "reading one can run code its author put there (d9d's own state loads with "
    "torch.load(weights_only=True)). Use only checkpoints you or your infrastructure wrote; "
    "share models as safetensors exports."
)


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
    plot.add_argument(
        "-o", "--output", type=Path, default=Path("metrics.png"), help="PNG, SVG or PDF (by suffix)"
    )

    inspect = commands.add_parser(
        "inspect",
        help="list what a DCP checkpoint or safetensors export holds",
        description="Lists a DCP checkpoint's tensors from its .metadata and checks its files against "
        "the d9d manifest (sizes and CRC-32), or a safetensors file's or directory's headers. " + _TRUSTED,
    )
    inspect.add_argument(
        "path", type=Path, help="a checkpoint step directory, a safetensors file or directory"
    )

    export = commands.add_parser(
        "export",
        help="turn a DCP training checkpoint into a Hugging Face directory (one CPU process, offline)",
        description="Builds the model of CONFIG on one CPU process, checks CHECKPOINT_DIR's files "
        "against its manifest, loads it (saved under any layout; every tensor of the model must be "
        "in it and every model tensor in it must be used) and writes OUT_DIR as safetensors plus the "
        "provider's files (config.json, tokenizer). LoRA adapters are merged as trainer.peft says. "
        + _TRUSTED,
    )
    export.add_argument("config", type=Path, help="the job's YAML config (its model and trainer sections)")
    export.add_argument("checkpoint", type=Path, help="a step_* checkpoint, or the directory holding them")
    export.add_argument("output", type=Path, help="the directory to write (its parent must exist)")
    export.add_argument(
        "--provider",
        default=None,
        help="module:function building your ModelProvider from the config mapping "
        "(default: d9d.hf:provider_from_config, from the config's model section)",
    )
    export.add_argument("--force", action="store_true", help="replace OUT_DIR even if it is not a d9d export")
    _add_estimate(commands)
    return parser


def _add_estimate(commands: Any) -> None:
    estimate = commands.add_parser(
        "estimate",
        help="predict each rank's peak device memory from a config (reads config.json, no weights)",
        description="Predicts each pipeline rank's peak device memory from the config: weights, "
        "gradients, optimizer state, compute copies, saved activations, the layer in backward, the "
        "LM head and loss, and the allocator's slack. Against a device (--device-memory, else this "
        "machine's first GPU) a job that does not fit exits with status 2, saying by how much and "
        "which switch would make it fit.",
    )
    estimate.add_argument("config", type=Path, help="the job's YAML config (model, trainer, optimizer)")
    estimate.add_argument("--device-memory", type=float, default=None, metavar="GIB", help="device GiB")
    estimate.add_argument(
        "--seq-len", type=int, default=None, help="tokens per row (default: dataset.sequence_length)"
    )
    estimate.add_argument(
        "--provider",
        default=None,
        help="module:function building your ModelProvider from the config mapping "
        "(default: d9d.hf:provider_from_config)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; returns 0, or 2 on bad input (one line on stderr names the file)."""
    args = _parser().parse_args(argv)
    from d9d.loop.cli._commands import run_command

    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
