"""Following a stage's initialization from the provider: a short walk through the core.

The walk is the chain of d9d-hf functions on the call stack from ``HFModelProvider``'s
``initialize_model_stage`` / ``load_model_stage`` down to the deepest call, cut at the family
boundary (a family's protocol method counts, what it calls inside its folder does not). Every
chain visits at most 8 functions and never re-enters a file it left for another one.
"""

from __future__ import annotations

import functools
import sys
from itertools import pairwise
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import d9d.hf
from d9d.hf import (
    DecoderCausalLM,
    HFModelProvider,
    PretrainedModelConfig,
    ScratchModelConfig,
    save_pretrained,
)
from d9d.hf._families import as_family
from d9d.loop import InitializeModelStageContext, LoadModelStageContext
from d9d.mesh import DistributedContext, MeshParameters
from d9d.mesh.testing import run_distributed
from d9d.pipeline import PipelineStageInfo

ROOT = Path(d9d.hf.__file__).parent
CORE = (ROOT / "_decoder", *(path for path in ROOT.glob("_*.py")))
TINY = {
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 2,
}
Chain = tuple[tuple[str, str], ...]


def _in_core(path: Path) -> bool:
    return any(path == core or core in path.parents for core in CORE)


@functools.cache
def _place(file: str) -> tuple[str, bool] | None:
    """A d9d-hf file's path relative to the package and whether it is the core's; None outside
    d9d-hf. Cached: the profile hook below asks for every frame of every call."""
    path = Path(file)
    if ROOT not in path.parents:
        return None
    return path.relative_to(ROOT).as_posix(), _in_core(path)


class _Walks:
    """The d9d-hf chains of every call made while it is active (see the module)."""

    def __init__(self) -> None:
        self.chains: set[Chain] = set()
        self._stack: list[tuple[tuple[str, bool] | None, str]] = []

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        del arg
        if event == "return" and self._stack:
            self._stack.pop()
        if event != "call":
            return
        self._stack.append((_place(frame.f_code.co_filename), frame.f_code.co_name))
        chain: list[tuple[str, str]] = []
        for place, name in self._stack:
            if place is None or name.startswith("<"):  # another package, a comprehension
                continue
            relative, core = place
            chain.append((relative, name))
            if not core:  # a family's method: the protocol boundary
                break
        self.chains.add(tuple(chain))

    def __enter__(self) -> _Walks:
        self._stack.clear()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *args: object) -> None:
        sys.setprofile(None)


def _reenters(chain: Chain) -> bool:
    left: set[str] = set()
    for (here, _), (there, _) in pairwise(chain):
        if here != there:
            left.add(here)
            if there in left:
                return True
    return False


def _walk(source: Path, heads: list[dict[str, Any]] | None) -> list[Chain]:
    context = DistributedContext(MeshParameters(), device_type="cpu")
    config = {"source": str(source)} if heads is None else {"source": str(source), "heads": heads}
    provider = HFModelProvider(PretrainedModelConfig.model_validate(config))
    stage = PipelineStageInfo(current_stage=0, num_stages=1)
    provider.model_config(context)  # the download / config read is not the stage's walk
    walks = _Walks()
    with walks, torch.device("meta"):
        model = provider.initialize_model_stage(
            InitializeModelStageContext(dist_context=context, stage=stage)
        ).model
    model.to_empty(device="cpu")
    with walks:
        provider.load_model_stage(LoadModelStageContext(dist_context=context, stage=stage, model=model))
    context.close()
    return sorted(walks.chains, key=len)


@pytest.mark.parametrize(
    "heads",
    [None, [{"kind": "causal_lm"}, {"kind": "classification", "name": "sentiment", "num_labels": 2}]],
    ids=["one-head", "two-heads"],
)
def test_a_stage_initializes_through_at_most_8_functions_never_reentering_a_file(
    tmp_path: Path, heads: list[dict[str, Any]] | None
) -> None:
    torch.manual_seed(0)
    model = DecoderCausalLM(as_family(ScratchModelConfig.model_validate({"config": TINY}).config))
    model.reset_parameters()
    save_pretrained(model, tmp_path / "source")
    chains = run_distributed(_walk, tmp_path / "source", heads, world_size=1)[0]
    assert chains[-1][0] in {("_provider.py", "initialize_model_stage"), ("_provider.py", "load_model_stage")}
    too_long = [chain for chain in chains if len(chain) > 8]
    assert not too_long, f"{len(too_long)} chains over 8 functions, the longest: {too_long[-1]}"
    reentering = [chain for chain in chains if _reenters(chain)]
    assert not reentering, f"chains re-entering a file they left: {reentering[:3]}"
