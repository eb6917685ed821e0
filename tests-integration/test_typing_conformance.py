"""Pyright assignability: d9d-kernels' producers fit d9d-parallel's Protocols, and back.

Each consumer declares its own Protocol; these checks make a drift between the two a type error in
CI. The snippet is checked by pyright in strict mode (as ``packages/d9d-loop/tests/test_typing.py``
does); every line marked ``# expect-error`` must be an error, and no other line may be.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SNIPPET = """
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from d9d.kernels.layers import AttentionBackend as KernelsAttentionBackend
from d9d.kernels.layers import (
    EagerAttentionBackend,
    FlashAttention2Backend,
    FlashAttention4Backend,
    GroupedQueryAttention,
    LocalTokenDispatcher,
    MoELayer,
    SdpaAttentionBackend,
)
from d9d.kernels.layers import TokenDispatcher as KernelsTokenDispatcher
from d9d.parallel import (
    AllToAllTokenDispatcher,
    AttentionBackend,
    AttentionLayerLike,
    ContextParallelAttention,
    DeepEPTokenDispatcher,
    MoELayerLike,
    TokenDispatcher,
    parallelize_context_parallel,
    parallelize_expert_parallel,
)


# d9d-kernels' layers are what d9d-parallel's strategies take.
def attention_layer(layer: GroupedQueryAttention) -> AttentionLayerLike:
    return layer


def moe_layer(layer: MoELayer) -> MoELayerLike:
    return layer


def parallelize(attention: GroupedQueryAttention, moe: MoELayer, mesh: DeviceMesh) -> None:
    parallelize_context_parallel(attention, mesh=mesh)
    parallelize_expert_parallel(moe, mesh=mesh)


# d9d-kernels' slot implementations fit d9d-parallel's view of the slots ...
def kernels_backends() -> list[AttentionBackend]:
    return [EagerAttentionBackend(), SdpaAttentionBackend(), FlashAttention2Backend(),
            FlashAttention4Backend()]


def kernels_dispatcher() -> TokenDispatcher:
    return LocalTokenDispatcher(4)


# ... and d9d-parallel's implementations fit d9d-kernels' slots.
def context_parallel_backend(mesh: DeviceMesh) -> KernelsAttentionBackend:
    return ContextParallelAttention(mesh=mesh)


def all_to_all_dispatcher(group: ProcessGroup) -> KernelsTokenDispatcher:
    return AllToAllTokenDispatcher(num_experts=4, group=group)


def deep_ep_dispatcher(group: ProcessGroup) -> KernelsTokenDispatcher:
    return DeepEPTokenDispatcher(num_experts=4, group=group)


def install(attention: GroupedQueryAttention, moe: MoELayer, mesh: DeviceMesh, group: ProcessGroup) -> None:
    attention.attention_backend = ContextParallelAttention(mesh=mesh)
    moe.dispatcher = AllToAllTokenDispatcher(num_experts=4, group=group)


# The checks can fail: a layer without the slot does not fit.
def moe_is_no_attention_layer(layer: MoELayer) -> AttentionLayerLike:
    return layer  # expect-error


def attention_is_no_moe_layer(layer: GroupedQueryAttention) -> MoELayerLike:
    return layer  # expect-error


def dispatcher_is_no_backend(dispatcher: AllToAllTokenDispatcher) -> KernelsAttentionBackend:
    return dispatcher  # expect-error
"""


def _pyright(tmp_path: Path) -> dict[str, object]:
    (tmp_path / "snippet.py").write_text(SNIPPET)
    (tmp_path / "pyrightconfig.json").write_text(
        json.dumps(
            {
                "typeCheckingMode": "strict",
                "pythonVersion": "3.11",
                "reportMissingTypeStubs": False,
                "reportUnknownMemberType": False,
                "venvPath": str(Path(sys.prefix).parent),
                "venv": Path(sys.prefix).name,
            }
        )
    )
    executable = shutil.which("pyright", path=str(Path(sys.executable).parent))
    if executable is None:
        pytest.skip("pyright is not installed in this environment")
    result = subprocess.run(
        [executable, "--outputjson", "snippet.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
    )
    return json.loads(result.stdout)


def test_producers_and_consumers_are_assignable_both_ways(tmp_path: Path) -> None:
    report = _pyright(tmp_path)
    diagnostics = report["generalDiagnostics"]
    assert isinstance(diagnostics, list)
    errors = {
        diagnostic["range"]["start"]["line"] + 1: diagnostic["message"]
        for diagnostic in diagnostics
        if diagnostic["severity"] == "error"
    }
    expected = {
        number for number, line in enumerate(SNIPPET.splitlines(), start=1) if "# expect-error" in line
    }
    assert len(expected) == 3
    assert set(errors) == expected, "\n".join(f"line {n}: {m}" for n, m in sorted(errors.items()))
