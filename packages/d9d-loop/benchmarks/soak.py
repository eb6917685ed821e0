"""Soak test of kill -9 and damaged checkpoints: does every resume end bit-exact with nothing lost?

Each trial trains the quickstart MLP on 4 CPU ranks (HSDP 2x2, gloo, ``d9d.mesh.testing``) with a
checkpoint after every step, kills every rank with SIGKILL at a random point (between steps,
inside a synchronous save, inside an asynchronous save), then, most of the time, damages the newest
checkpoint: truncates, deletes, or flips 4 bytes of a random file, or writes a NaN into a model
weight with the file's size unchanged (``nan``: resumed with ``verify: sizes``, so only the
non-finite check after loading finds it). The run is then resumed to the end and compared with an
uninterrupted reference run:

- bit-exact: the losses of the resumed steps and the final parameters equal the reference's;
- nothing lost: it resumed from the newest checkpoint, or from the one before when the newest
  was damaged.

It also measures what resume verification costs: ``stat`` per file (``verify: sizes``) and
CRC-32 throughput (``verify: checksums``) on a file of ``--verify-mb`` MiB.

Run:  uv run packages/d9d-loop/benchmarks/soak.py [--trials 20] [--seed 0] [--verify-mb 256]
          [--damages none,truncate,delete,flip,nan]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from d9d.loop import (
    AutoDataProvider,
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    EventBus,
    ForwardBackwardFinished,
    ProjectConfig,
    StepFinished,
    TrainingConfigurator,
)
from d9d.loop.checkpoint._manifest import MANIFEST_FILE, FileRecord, check_files, crc32_of
from d9d.mesh.testing import DistributedTestError, run_distributed

REPO = Path(__file__).resolve().parents[3]
STEPS = 12
WORLD = 4
KILLS = ("between-steps", "inside-save", "inside-async-save")
DAMAGES = ("none", "truncate", "delete", "flip", "nan")
NAN = b"\x00\x00\xc0\x7f"  # float32 NaN, little-endian


def _load_quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart", REPO / "examples" / "quickstart" / "train.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("cannot load examples/quickstart/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(directory: str | None, asynchronous: bool, verify: str = "checksums") -> ProjectConfig:
    trainer: dict[str, Any] = {
        "max_steps": STEPS,
        "global_batch_size": 64,
        "microbatch_size": 8,
        "seed": 3,
        "logging": {"progress_bar": False},
        "device": "cpu",
    }
    if directory is not None:
        trainer["checkpoint"] = {
            "directory": directory,
            "every_steps": 1,
            "keep_last": 2,
            "asynchronous": asynchronous,
            "verify": verify,
        }
    return ProjectConfig.model_validate(
        {
            "mesh": {"data_parallel_replicate": 2, "data_parallel_shard": 2},
            "trainer": trainer,
            "data": {"seed": 5},
            "optimizer": {"name": "adamw", "lr": 0.003},
            "lr_scheduler": {
                "name": "piecewise",
                "warmup": {"steps": 3},
                "phases": [{"kind": "cosine", "fraction": 1.0}],
            },
        }
    )


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _train(
    directory: str | None, asynchronous: bool, kill: str | None, kill_step: int, verify: str = "checksums"
) -> dict[str, Any]:
    """One rank of a run; with ``kill`` it SIGKILLs itself at ``kill_step``."""
    logging.getLogger("d9d").setLevel(logging.ERROR)  # the fallback warnings are expected here
    qs = _load_quickstart()
    config = _config(directory, asynchronous, verify)
    events = EventBus()
    losses: list[float] = []
    events.subscribe(ForwardBackwardFinished, lambda e: losses.append(e.loss))
    if kill == "between-steps":
        events.subscribe(StepFinished, lambda e: _kill_self() if e.step == kill_step else None)
    elif kill is not None and directory is not None:
        partial = Path(directory) / f"step_{kill_step:09d}.partial"

        def watch() -> None:
            while True:
                if partial.is_dir() and any(partial.iterdir()):
                    _kill_self()
                time.sleep(0.0005)

        threading.Thread(target=watch, daemon=True).start()
    trainer = TrainingConfigurator(
        mesh=config.mesh,
        parameters=config.trainer,
        model_provider=qs.MLPProvider(),
        task_provider=lambda ctx: qs.RegressionTask(),
        data_provider=AutoDataProvider(
            dataset_factory=lambda dist_context: qs.RegressionDataset(4096, 16),
            collator=qs.RegressionDataset.collate,
            config=config.data,
        ),
        optimizer_provider=AutoOptimizerProvider(config.optimizer),
        lr_scheduler_provider=AutoLRSchedulerProvider(config.lr_scheduler),
        events=events,
    ).configure()
    trainer.train()
    params = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in trainer.model_stages[0].named_parameters()
    }
    trainer.close()
    trainer.dist_context.close()
    return {"losses": losses, "params": params, "start": STEPS - len(losses)}


def _complete(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith("step_") and "." not in p.name)


def _model_weights(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor) and tree.dtype == torch.float32 and tree.numel() >= 4:
        found[prefix] = tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            found |= _model_weights(value, f"{prefix}.{key}" if prefix else str(key))
    return found


def _poison(step_dir: Path, rng: random.Random) -> str:
    """Writes a NaN over the first element of a random model weight; every file keeps its size."""
    whole = step_dir.parent / "poison.pt"
    dcp_to_torch_save(str(step_dir), str(whole))
    saved: dict[str, Any] = torch.load(whole, weights_only=False)
    whole.unlink()
    weights = _model_weights(saved.get("model", {}), "model")
    name = rng.choice(sorted(weights))
    needle = weights[name].flatten()[:4].contiguous().view(torch.uint8).numpy().tobytes()
    for shard in sorted(step_dir.glob("*.distcp")):
        data = bytearray(shard.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at : at + 4] = NAN
            shard.write_bytes(bytes(data))
            return f"nan in {name} ({shard.relative_to(step_dir.parent)})"
    raise RuntimeError(f"the bytes of {name} were not found in {step_dir}")


def _damage(step_dir: Path, kind: str, rng: random.Random) -> str:
    if kind == "nan":
        return _poison(step_dir, rng)
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    target = rng.choice(files)
    data = target.read_bytes()
    match kind:
        case "truncate":
            target.write_bytes(data[: rng.randrange(len(data))])
        case "delete":
            target.unlink()
        case "flip":
            at = rng.randrange(max(len(data) - 4, 1))
            flipped = bytearray(data)
            for i in range(at, min(at + 4, len(data))):
                flipped[i] ^= 0xFF
            target.write_bytes(bytes(flipped))
        case _:
            raise ValueError(kind)
    return f"{kind} {target.relative_to(step_dir.parent)}"


@dataclass(kw_only=True)
class Trial:
    kill: str
    kill_step: int
    damage: str
    expected_start: int
    start: int = -1
    bit_exact: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.bit_exact and self.start == self.expected_start


def _trial(
    root: Path, index: int, rng: random.Random, reference: dict[str, Any], damages: tuple[str, ...]
) -> Trial:
    directory = root / f"trial_{index:03d}"
    kill = rng.choice(KILLS)
    kill_step = rng.randrange(2, STEPS - 1)
    asynchronous = kill == "inside-async-save"
    try:
        run_distributed(
            _train, str(directory), asynchronous, kill, kill_step, world_size=WORLD, timeout_s=300
        )
        raise RuntimeError("the run was not killed")
    except DistributedTestError as e:
        if "-9" not in str(e):
            raise
    complete = _complete(directory)
    damage = rng.choice(damages) if len(complete) >= 2 else "none"
    described = "none"
    expected = int(complete[-1].name.split("_")[1]) if complete else 0
    if damage != "none":
        described = _damage(complete[-1], damage, rng)
        expected = int(complete[-2].name.split("_")[1])
    trial = Trial(kill=kill, kill_step=kill_step, damage=described, expected_start=expected)
    try:
        verify = "sizes" if damage == "nan" else "checksums"  # a NaN keeps sizes: the load check finds it
        resumed = run_distributed(
            _train, str(directory), asynchronous, None, 0, verify, world_size=WORLD, timeout_s=300
        )[0]
    except DistributedTestError as e:
        trial.error = str(e).splitlines()[-1][:200]
        return trial
    trial.start = resumed["start"]
    trial.bit_exact = resumed["losses"] == reference["losses"][trial.start :] and all(
        torch.equal(resumed["params"][n], v) for n, v in reference["params"].items()
    )
    return trial


def _verification_cost(megabytes: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "__0_0.distcp"
        path.write_bytes(os.urandom(megabytes << 20))
        record = FileRecord(name=path.name, size=path.stat().st_size, crc32=crc32_of(path))
        start = time.perf_counter()
        for _ in range(1000):
            check_files(Path(tmp), [record], "sizes")
        sizes_us = (time.perf_counter() - start) * 1000  # per call, in microseconds
        start = time.perf_counter()
        check_files(Path(tmp), [record], "checksums")
        seconds = time.perf_counter() - start
    return (
        f"verification: sizes {sizes_us:.1f} us per file; checksums {megabytes / seconds:.0f} MiB/s "
        f"per rank (CRC-32 of a {megabytes} MiB file in the page cache, {seconds:.2f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="kill points (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify-mb", type=int, default=256, help="file size for the verification cost")
    parser.add_argument(
        "--damages", default=",".join(DAMAGES), help=f"damages to draw from (default {','.join(DAMAGES)})"
    )
    args = parser.parse_args()
    damages = tuple(d.strip() for d in args.damages.split(",") if d.strip())
    unknown = sorted(set(damages) - set(DAMAGES))
    if unknown or not damages:
        parser.error(f"--damages: unknown {unknown}; choose from {list(DAMAGES)}")
    rng = random.Random(args.seed)
    print(_verification_cost(args.verify_mb), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference = run_distributed(_train, None, False, None, 0, world_size=WORLD, timeout_s=300)[0]
        trials: list[Trial] = []
        for index in range(args.trials):
            trial = _trial(root, index, rng, reference, damages)
            trials.append(trial)
            verdict = "ok" if trial.ok else f"FAILED {trial.error}"
            print(
                f"trial {index:2d}: kill {trial.kill} at step {trial.kill_step}, damage {trial.damage}: "
                f"resumed at {trial.start} (expected {trial.expected_start}), "
                f"bit-exact {trial.bit_exact}: {verdict}",
                flush=True,
            )
    good = sum(t.ok for t in trials)
    print(f"{good} of {len(trials)} resumes ended bit-exact with nothing lost")


if __name__ == "__main__":
    main()
