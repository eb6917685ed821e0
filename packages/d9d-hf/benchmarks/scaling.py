"""Multi-GPU scaling of the d9d job: each layout against one GPU, and one GPU against a peer, in one call.

For every model shape and round, runs with ``train_throughput.py`` (each in its own process; the
layouts under ``torchrun``):

- the one-GPU reference of each layout (the same sequence length, per-replica batch and microbatch
  size on one process), once per round and shared by the layouts that need the same one;
- each layout on ``--gpus`` ranks: ``dp_shard`` (``data_parallel_shard: N``), ``cp``
  (``context_parallel_shard: N`` at ``--cp-seq`` tokens, batch 1), ``pp:<schedule>`` (pipeline over
  N ranks, ``--microbatches`` microbatches of one sample);
- with ``--peer``, that implementation (e.g. torchtitan) on one GPU at the dp reference's shape.

Rounds alternate every run, so a slow phase of the machine hits each alike; every ratio is taken
within a round and the table prints its median over the rounds with the range. Printed per layout:
the speed-up over one GPU (total tok/s), the per-GPU efficiency, and for pipelines the measured
bubble (``1 - per-GPU efficiency``) next to the d9d-pipeline simulator's; with ``--busy`` also
the GPU idle share of the most idle rank against the one-GPU run's (two profiled steps each).

    python3 scaling.py --gpus 2 --models dense dense4b --repeats 3 --peer titan
    python3 scaling.py --gpus 2 --layouts pp:1f1b pp:zbv --microbatches 8 --json runs.jsonl
    python3 scaling.py --summarize runs.jsonl other_call.jsonl   # the table from earlier calls
    python3 scaling.py --device cpu --quick --seq 64 --cp-seq 128 --steps 2 --warmup 1  # gloo smoke

``--json`` appends every run's record (with its round, model and layout) so that the runs of
several calls (the GPU machine limits one command's time) can be summarized together.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _stats import spread

THROUGHPUT = Path(__file__).with_name("train_throughput.py")


@dataclass(frozen=True)
class Run:
    """One process (or torchrun group) of ``train_throughput.py``.

    Attributes:
        model: The ``--model`` shape.
        layout: ``one_gpu`` (a reference), ``peer`` or a layout name (``dp_shard``, ``cp``,
            ``pp:<schedule>``).
        ranks: Processes (1 for references and the peer).
        options: The shape options: ``--seq``, ``--batch``, ``--microbatches``, ``--pp``, ``--cp``.
    """

    model: str
    layout: str
    ranks: int
    options: tuple[tuple[str, int | str], ...]

    def reference(self) -> Run:
        """The one-GPU run that did one replica's work of this one."""
        shape = tuple((k, v) for k, v in self.options if k in ("seq", "batch", "microbatches"))
        return Run(self.model, "one_gpu", 1, shape)


def planned_layouts(args: argparse.Namespace, model: str) -> list[Run]:
    """The runs on ``--gpus`` ranks that ``--layouts`` asks for."""
    n = args.gpus
    runs: list[Run] = []
    for layout in args.layouts:
        match layout.split(":"):
            case ["dp_shard"]:
                options = (("seq", args.seq), ("batch", args.batch), ("microbatches", 1))
            case ["cp"]:
                options = (("seq", args.cp_seq), ("batch", 1), ("microbatches", 1), ("cp", n))
            case ["pp", schedule]:
                options = (
                    ("seq", args.seq),
                    ("batch", args.microbatches),
                    ("microbatches", args.microbatches),
                    ("pp", n),
                    ("schedule", schedule),
                )
            case _:
                raise ValueError(f"unknown layout {layout!r}: dp_shard, cp or pp:<schedule>")
        runs.append(Run(model, layout, n, options))
    return runs


def command_of(args: argparse.Namespace, run: Run, implementation: str, output: Path) -> list[str]:
    """The command line of ``run``: python for one process, torchrun for several."""
    launcher = [sys.executable]
    if run.ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={run.ranks}"]
    command = [*launcher, str(THROUGHPUT), "--impl", implementation, "--json", str(output)]
    command += [f"--model={run.model}", f"--device={args.device}"]
    command += [f"--steps={args.steps}", f"--warmup={args.warmup}"]
    command += [f"--{key.replace('_', '-')}={value}" for key, value in run.options]
    if implementation.startswith("d9d"):
        command += [f"--d9d-state={args.d9d_state}", f"--read-figures={args.read_figures}"]
        command += ["--busy"] if args.busy else []
    return command + (["--quick"] if args.quick else [])


def execute(
    args: argparse.Namespace, run: Run, implementation: str, round_index: int
) -> dict[str, Any] | None:
    """Runs ``run``; returns its record tagged with round, model and layout (None if it failed)."""
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "record.jsonl"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        command = command_of(args, run, implementation, output)
        process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            _, stderr = process.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:  # one stuck run must not end the others
            _stop(process)
            print(f"{run.model} {run.layout}: no result within --timeout {args.timeout:.0f} s", flush=True)
            return None
        if process.returncode != 0 or not output.exists():
            print(f"{run.model} {run.layout}: FAILED\n{stderr[-3000:]}", flush=True)
            return None
        record: dict[str, Any] = json.loads(output.read_text().splitlines()[-1])
    record.update(round=round_index, model=run.model, layout=run.layout, ranks=run.ranks)
    record["reference_key"] = json.dumps(run.reference().options)
    print(
        f"round {round_index + 1}: {run.model} {run.layout} on {run.ranks}: "
        f"{record['tokens_per_s'] / 1e3:.2f}k tok/s",
        flush=True,
    )
    return record


def _measured(value: float | None) -> bool:
    """Whether a figure was measured (peak memory is NaN on a CPU)."""
    return value is not None and not math.isnan(value) and value > 0


def _stop(process: subprocess.Popen[str]) -> None:
    """Ends a run past its time and its workers.

    SIGTERM first: torchrun then stops its workers, which run in sessions of their own and would
    outlive a killed torchrun. SIGKILL to the run's process group if it is still there after 30 s.
    """
    process.terminate()
    try:
        process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


def summarize(records: list[dict[str, Any]]) -> list[str]:
    """The table: each layout against the one-GPU run of the same round, model and shape.

    Returns:
        Markdown lines: with peer runs, a table of d9d against the peer on one GPU; then one row
        per (model, layout); ratios as median (range) over the rounds that hold both runs.
    """
    references = {
        (r["round"], r["model"], r["reference_key"]): r for r in records if r["layout"] == "one_gpu"
    }
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    peers: dict[tuple[str, str], dict[str, list[float]]] = {}
    for record in records:
        if record["layout"] == "one_gpu":
            continue
        reference = references.get((record["round"], record["model"], record["reference_key"]))
        if reference is None:
            continue
        if record["layout"] == "peer":
            figures = peers.setdefault((record["model"], record["implementation"]), {})
            figures.setdefault("d9d", []).append(reference["tokens_per_s"] / 1e3)
            figures.setdefault("peer", []).append(record["tokens_per_s"] / 1e3)
            figures.setdefault("ratio", []).append(reference["tokens_per_s"] / record["tokens_per_s"])
            if _measured(record.get("peak_memory_gib")) and _measured(reference.get("peak_memory_gib")):
                figures.setdefault("memory", []).append(
                    reference["peak_memory_gib"] / record["peak_memory_gib"]
                )
            continue
        figures = rows.setdefault((record["model"], record["layout"]), {})
        speedup = record["tokens_per_s"] / reference["tokens_per_s"]
        figures.setdefault("ranks", []).append(record["ranks"])
        figures.setdefault("one", []).append(reference["tokens_per_s"] / 1e3)
        figures.setdefault("layout", []).append(record["tokens_per_s"] / 1e3)
        figures.setdefault("speedup", []).append(speedup)
        figures.setdefault("efficiency", []).append(speedup / record["ranks"])
        if _measured(record.get("peak_memory_gib")) and _measured(reference.get("peak_memory_gib")):
            figures.setdefault("memory", []).append(record["peak_memory_gib"] / reference["peak_memory_gib"])
        idle = record.get("device_idle_per_rank")
        reference_idle = reference.get("device_idle_per_rank")
        if idle and reference_idle:
            figures.setdefault("idle", []).append(100 * max(idle))
            figures.setdefault("reference_idle", []).append(100 * reference_idle[0])
        pipeline = record.get("pipeline")
        if pipeline is not None:
            figures.setdefault("bubble", []).append(100 * (1 - speedup / record["ranks"]))
            figures.setdefault("predicted", []).append(100 * pipeline["predicted_bubble"])
    lines = (
        [
            "| model | one GPU: d9d k tok/s | peer | peer k tok/s | d9d vs peer | d9d memory vs peer |",
            "|---|---|---|---|---|---|",
            *(
                f"| {model} | {spread(f['d9d'])} | {peer} | {spread(f['peer'])} | {spread(f['ratio'])} "
                f"| {spread(f.get('memory', []))} |"
                for (model, peer), f in peers.items()
            ),
            "",
        ]
        if peers
        else []
    )
    lines += [
        "| model | layout | GPUs | one GPU k tok/s | layout k tok/s | speed-up | per-GPU efficiency "
        "| memory per GPU vs one | pipeline bubble % measured / simulator "
        "| GPU idle %: most idle rank / one GPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (model, layout), f in rows.items():
        bubble = f"{spread(f['bubble'], 1)} / {spread(f['predicted'], 1)}" if "bubble" in f else "-"
        idle = f"{spread(f['idle'], 1)} / {spread(f['reference_idle'], 1)}" if "idle" in f else "-"
        lines.append(
            f"| {model} | {layout} | {int(f['ranks'][0])} | {spread(f['one'])} | {spread(f['layout'])} "
            f"| {spread(f['speedup'])} | {spread(f['efficiency'])} | {spread(f.get('memory', []))} "
            f"| {bubble} | {idle} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=2, help="ranks of every layout")
    parser.add_argument("--models", nargs="+", default=["dense"], help="train_throughput.py --model shapes")
    parser.add_argument("--layouts", nargs="+", default=["dp_shard", "cp", "pp:1f1b", "pp:zbv"])
    parser.add_argument("--impl", default="d9d_compile", choices=["d9d", "d9d_compile"])
    parser.add_argument("--peer", help="also run this implementation on one GPU (e.g. titan) against d9d")
    parser.add_argument("--d9d-state", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument(
        "--read-figures",
        choices=["after_step", "during_next_step"],
        default="after_step",
        help="d9d: trainer.logging.read_figures",
    )
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="samples per data-parallel replica")
    parser.add_argument("--cp-seq", type=int, default=32768, help="the cp layout's sequence length")
    parser.add_argument(
        "--microbatches", type=int, default=4, help="the pp layouts' microbatches of 1 sample"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model, for a smoke run")
    parser.add_argument(
        "--busy", action="store_true", help="profile two extra steps per d9d run: GPU idle time per rank"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", help="append every run's record here")
    parser.add_argument(
        "--summarize", nargs="+", metavar="JSONL", help="only print the table of these records"
    )
    args = parser.parse_args()
    if args.summarize:
        records = [
            json.loads(line) for path in args.summarize for line in Path(path).read_text().splitlines()
        ]
        print("\n".join(summarize(records)))
        return
    records: list[dict[str, Any]] = []
    for round_index in range(args.repeats):
        for model in args.models:
            layouts = planned_layouts(args, model)
            references = list(dict.fromkeys(run.reference() for run in layouts))
            runs = [(run, args.impl) for run in references]
            for run in layouts:
                runs.append((run, args.impl))
            if args.peer is not None:
                shape = (("seq", args.seq), ("batch", args.batch), ("microbatches", 1))
                runs.append((Run(model, "peer", 1, shape), args.peer))
            for run, implementation in runs:
                record = execute(args, run, implementation, round_index)
                if record is None:
                    continue
                records.append(record)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(record) + "\n")
    print("\n".join(summarize(records)))


if __name__ == "__main__":
    main()
