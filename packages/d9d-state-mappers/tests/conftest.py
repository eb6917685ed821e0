"""A tiny Hugging Face style MoE checkpoint layout, its fused counterpart, and mappers between them.

HF layout (per layer): separate q/k/v projections, per-expert gate/up/down weights.
Fused layout (per layer): one qkv weight, experts stacked and transposed into ``(E, H, 2I)``
gate/up and ``(E, I, H)`` down tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from d9d.state_mappers import (
    ChunkMapper,
    ConcatenateMapper,
    ParallelMapper,
    PrefixMapper,
    RenameMapper,
    SelectMapper,
    SequentialMapper,
    StackMapper,
    StateMapper,
    TransposeMapper,
    UnstackMapper,
)

LAYERS, EXPERTS, HIDDEN, INTER, VOCAB = 2, 4, 8, 6, 10
Q_ROWS, KV_ROWS = 8, 4
HF_PLAIN = {
    "self_attn.o_proj.weight": "attn.o.weight",
    "mlp.gate.weight": "moe.router.weight",
    "input_layernorm.weight": "norm.weight",
}
HF_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
}


def hf_state(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A random HF-style state dict."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    state = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    state["lm_head.weight"] = rand(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = rand(Q_ROWS, HIDDEN)
        state[p + "self_attn.k_proj.weight"] = rand(KV_ROWS, HIDDEN)
        state[p + "self_attn.v_proj.weight"] = rand(KV_ROWS, HIDDEN)
        state[p + "self_attn.o_proj.weight"] = rand(HIDDEN, Q_ROWS)
        state[p + "mlp.gate.weight"] = rand(EXPERTS, HIDDEN)
        state[p + "input_layernorm.weight"] = rand(HIDDEN)
        for e in range(EXPERTS):
            state[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(INTER, HIDDEN)
            state[p + f"mlp.experts.{e}.up_proj.weight"] = rand(INTER, HIDDEN)
            state[p + f"mlp.experts.{e}.down_proj.weight"] = rand(HIDDEN, INTER)
    return state


def fused_reference(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused layout computed directly with torch ops (the reference for the mappers)."""
    out = {new: hf[old] for old, new in HF_TOP.items()}
    for i in range(LAYERS):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[q + "attn.qkv.weight"] = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        for old, new in HF_PLAIN.items():
            out[q + new] = hf[p + old]
        gate_up = [
            torch.cat(
                [hf[p + f"mlp.experts.{e}.gate_proj.weight"], hf[p + f"mlp.experts.{e}.up_proj.weight"]]
            )
            for e in range(EXPERTS)
        ]
        out[q + "moe.gate_up"] = torch.stack(gate_up).transpose(1, 2).contiguous()
        down = [hf[p + f"mlp.experts.{e}.down_proj.weight"] for e in range(EXPERTS)]
        out[q + "moe.down"] = torch.stack(down).transpose(1, 2).contiguous()
    return out


def _expert(e: int, kind: str) -> str:
    return f"mlp.experts.{e}.{kind}_proj.weight"


def _layer_to_fused() -> StateMapper:
    experts = SequentialMapper(
        [
            ParallelMapper(
                [
                    ConcatenateMapper([_expert(e, "gate"), _expert(e, "up")], f"gate_up.{e}")
                    for e in range(EXPERTS)
                ]
                + [RenameMapper(_expert(e, "down"), f"down.{e}") for e in range(EXPERTS)]
            ),
            ParallelMapper(
                [
                    StackMapper([f"gate_up.{e}" for e in range(EXPERTS)], "gate_up"),
                    StackMapper([f"down.{e}" for e in range(EXPERTS)], "down"),
                ]
            ),
            ParallelMapper(
                [
                    TransposeMapper("gate_up", dim0=1, dim1=2, ndim=3, target="moe.gate_up"),
                    TransposeMapper("down", dim0=1, dim1=2, ndim=3, target="moe.down"),
                ]
            ),
        ]
    )
    qkv = ConcatenateMapper([f"self_attn.{x}_proj.weight" for x in "qkv"], "attn.qkv.weight")
    plain = ParallelMapper([RenameMapper(old, new) for old, new in HF_PLAIN.items()])
    return ParallelMapper([qkv, plain, experts])


def _layer_to_hf() -> StateMapper:
    experts = SequentialMapper(
        [
            ParallelMapper(
                [
                    TransposeMapper("moe.gate_up", dim0=1, dim1=2, ndim=3, target="gate_up"),
                    TransposeMapper("moe.down", dim0=1, dim1=2, ndim=3, target="down"),
                ]
            ),
            ParallelMapper(
                [
                    UnstackMapper("gate_up", [f"gate_up.{e}" for e in range(EXPERTS)]),
                    UnstackMapper("down", [_expert(e, "down") for e in range(EXPERTS)]),
                ]
            ),
            ParallelMapper(
                [ChunkMapper(f"gate_up.{e}", [_expert(e, "gate"), _expert(e, "up")]) for e in range(EXPERTS)]
                + [SelectMapper([_expert(e, "down") for e in range(EXPERTS)])]
            ),
        ]
    )
    qkv = ChunkMapper(
        "attn.qkv.weight", [f"self_attn.{x}_proj.weight" for x in "qkv"], sizes=[Q_ROWS, KV_ROWS, KV_ROWS]
    )
    plain = ParallelMapper([RenameMapper(new, old) for old, new in HF_PLAIN.items()])
    return ParallelMapper([qkv, plain, experts])


def hf_to_fused_mapper() -> StateMapper:
    layers = [
        PrefixMapper(_layer_to_fused(), input_prefix=f"model.layers.{i}.", output_prefix=f"layers.{i}.")
        for i in range(LAYERS)
    ]
    return ParallelMapper([*layers, *(RenameMapper(old, new) for old, new in HF_TOP.items())])


def fused_to_hf_mapper() -> StateMapper:
    layers = [
        PrefixMapper(_layer_to_hf(), input_prefix=f"layers.{i}.", output_prefix=f"model.layers.{i}.")
        for i in range(LAYERS)
    ]
    return ParallelMapper([*layers, *(RenameMapper(new, old) for old, new in HF_TOP.items())])


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, Q_ROWS + 2 * KV_ROWS, bias=False)
        self.o = nn.Linear(Q_ROWS, HIDDEN, bias=False)


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * INTER))
        self.down = nn.Parameter(torch.randn(EXPERTS, INTER, HIDDEN))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.moe = _MoE()
        self.norm = nn.RMSNorm(HIDDEN)


class FusedModel(nn.Module):
    """A module whose state dict has the fused layout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([_Layer() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)


def write_sharded(state: dict[str, torch.Tensor], directory: Path, files: int, *, index: bool) -> None:
    """Writes ``state`` into ``files`` safetensors files (round robin by name), with or without an index."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    weight_map: dict[str, str] = {}
    for f in range(files):
        file_name = f"part-{f}.safetensors"
        chunk = {n: state[n].contiguous() for n in names[f::files]}
        save_file(chunk, directory / file_name)
        weight_map.update(dict.fromkeys(chunk, file_name))
    if index:
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )


@dataclass(frozen=True, kw_only=True)
class Layouts:
    """The helpers above, handed to tests through the ``layouts`` fixture."""

    hf_state: Callable[..., dict[str, torch.Tensor]] = hf_state
    fused_reference: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = fused_reference
    hf_to_fused_mapper: Callable[[], StateMapper] = hf_to_fused_mapper
    fused_to_hf_mapper: Callable[[], StateMapper] = fused_to_hf_mapper
    fused_model: Callable[[], nn.Module] = FusedModel
    write_sharded: Callable[..., None] = write_sharded


@pytest.fixture
def layouts() -> Layouts:
    """Builders of the HF-style and fused layouts."""
    return Layouts()
