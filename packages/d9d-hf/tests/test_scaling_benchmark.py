"""The scaling benchmark's plan, commands and table (its runs need GPUs; these parts do not)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_PATH = Path(__file__).parents[1] / "benchmarks" / "scaling.py"


@pytest.fixture(scope="module")
def scaling() -> ModuleType:
    spec = importlib.util.spec_from_file_location("d9d_hf_scaling_benchmark", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through it
    sys.path.insert(0, str(_PATH.parent))  # its sibling modules, as when run as a script
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_PATH.parent))
    return module


def _args(**overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = {
        "gpus": 2, "layouts": ["dp_shard", "cp", "pp:zbv"], "seq": 4096, "batch": 4, "cp_seq": 32768,
        "microbatches": 4, "device": "cuda", "steps": 10, "warmup": 5, "d9d_state": "bfloat16",
        "read_figures": "after_step", "quick": False, "busy": False,
    }  # fmt: skip
    return argparse.Namespace(**{**values, **overrides})


def test_each_layout_has_the_one_gpu_reference_of_one_replicas_work(scaling: ModuleType) -> None:
    dp, cp, pp = scaling.planned_layouts(_args(), "dense")
    assert dict(dp.reference().options) == {"seq": 4096, "batch": 4, "microbatches": 1}
    assert dict(cp.reference().options) == {"seq": 32768, "batch": 1, "microbatches": 1}
    assert dict(pp.reference().options) == {"seq": 4096, "batch": 4, "microbatches": 4}
    assert (dp.ranks, cp.ranks, pp.ranks) == (2, 2, 2)
    with pytest.raises(ValueError, match="unknown layout 'tp'"):
        scaling.planned_layouts(_args(layouts=["tp"]), "dense")


def test_layouts_run_under_torchrun_and_references_in_one_process(scaling: ModuleType) -> None:
    _, _, pp = scaling.planned_layouts(_args(), "dense4b")
    command = scaling.command_of(_args(), pp, "d9d_compile", Path("out.jsonl"))
    assert command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert {"--model=dense4b", "--pp=2", "--schedule=zbv", "--microbatches=4", "--d9d-state=bfloat16"} <= set(
        command
    )
    reference = scaling.command_of(_args(), pp.reference(), "d9d_compile", Path("out.jsonl"))
    assert "torch.distributed.run" not in reference and "--pp=2" not in reference
    peer = scaling.command_of(_args(), pp.reference(), "titan", Path("out.jsonl"))
    assert not any(option.startswith("--d9d-state") for option in peer)


def _record(round_index: int, layout: str, tokens_per_s: float, key: Any, **extra: Any) -> dict[str, Any]:
    ranks = 1 if layout in ("one_gpu", "peer") else 2
    return {
        "round": round_index, "model": "dense", "layout": layout, "ranks": ranks,
        "implementation": extra.pop("implementation", "d9d_compile"), "tokens_per_s": tokens_per_s,
        "peak_memory_gib": extra.pop("memory", 10.0), "reference_key": json.dumps(key), **extra,
    }  # fmt: skip


def test_the_table_pairs_each_run_with_its_rounds_reference(scaling: ModuleType) -> None:
    dp_key = [["seq", 4096], ["batch", 4], ["microbatches", 1]]
    pp_key = [["seq", 4096], ["batch", 4], ["microbatches", 4]]
    records = [
        _record(0, "one_gpu", 1000.0, dp_key, device_idle_per_rank=[0.04]),
        _record(0, "one_gpu", 900.0, pp_key),
        _record(0, "dp_shard", 1900.0, dp_key, memory=6.0, device_idle_per_rank=[0.05, 0.125]),
        _record(0, "pp:1f1b", 1440.0, pp_key, pipeline={"predicted_bubble": 0.2}),
        _record(0, "peer", 800.0, dp_key, implementation="titan", memory=20.0),
        _record(1, "one_gpu", 500.0, dp_key),  # a slow round: its ratios use its own reference
        _record(1, "dp_shard", 800.0, dp_key, memory=6.0),
        _record(2, "dp_shard", 5000.0, dp_key),  # no reference in its round: left out
    ]
    lines = scaling.summarize(records)
    assert lines[2] == "| dense | 1.00 | titan | 0.80 | 1.25 | 0.50 |"  # d9d 1.25x titan at half its memory
    rows = {
        line.split(" | ")[1]: line for line in lines if line.startswith("| dense | ") and "k tok" not in line
    }
    assert "| 1.75 (1.60-1.90) | 0.88 (0.80-0.95) | 0.60 (0.60-0.60) | - | 12.5 / 4.0 |" in rows["dp_shard"]
    # 1440 / 900 = 1.6x on 2 GPUs: 80% per GPU, a 20% bubble against the simulator's 20%
    assert rows["pp:1f1b"].endswith("| 1.60 | 0.80 | 1.00 | 20.0 / 20.0 | - |")
