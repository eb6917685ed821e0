"""Hugging Face <-> d9d tensor names and layouts of Qwen3 models, as state-mapper graphs.

One table lists, for a model, each d9d tensor and the HF tensor(s) it comes from; both
directions are read off that table. Names are the same on both sides except the router
(``mlp.gate.weight`` / ``mlp.router.weight``), the classifier (``score.weight`` /
``score.classifier.weight``) and the experts: HF stores ``mlp.experts.{e}.{gate,up,down}_proj.weight``
per expert as ``nn.Linear`` weights (out, in); d9d stores one ``(E, in, out)`` tensor per projection.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from d9d.hf._head import HeadName
from d9d.hf.qwen3._spec import Qwen3Spec
from d9d.hf.qwen3._stage import StageLayout
from d9d.state_mappers import (
    DropMapper,
    FilterMapper,
    ParallelMapper,
    RenameMapper,
    SequentialMapper,
    StackMapper,
    StateMapper,
    TransposeMapper,
    UnstackMapper,
)

HF_HEAD_TENSORS = ("lm_head.weight", "score.weight")
"""Head tensors a checkpoint may carry that another head does not read (dropped at load)."""


@dataclass(frozen=True)
class _Tensor:
    hf: str
    d9d: str


@dataclass(frozen=True)
class _Experts:
    hf: tuple[str, ...]
    d9d: str


_Entry = _Tensor | _Experts


def hf_prefix(head: HeadName) -> str:
    """Prefix of backbone names in the checkpoint transformers writes for ``head``."""
    match head:
        case "causal_lm" | "sequence_classification":
            return "model."
        case "embedding":
            return ""


def _layer_entries(spec: Qwen3Spec, index: int, prefix: str) -> list[_Entry]:
    hf = f"{prefix}layers.{index}."
    ours = f"model.layers.{index}."
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if spec.attention_bias:
        names += [f"self_attn.{p}_proj.bias" for p in "qkvo"]
    names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    entries: list[_Entry] = [_Tensor(hf + n, ours + n) for n in names]
    if spec.moe is not None and spec.moe_layers[index]:
        entries.append(_Tensor(hf + "mlp.gate.weight", ours + "mlp.router.weight"))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            sources = tuple(f"{hf}mlp.experts.{e}.{proj}.weight" for e in range(spec.moe.num_experts))
            entries.append(_Experts(sources, f"{ours}mlp.experts.{proj}"))
    else:
        entries += [
            _Tensor(f"{hf}mlp.{p}.weight", f"{ours}mlp.{p}.weight")
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
    return entries


def _entries(spec: Qwen3Spec, head: HeadName, layout: StageLayout, prefix: str) -> list[_Entry]:
    entries: list[_Entry] = []
    if layout.is_first:
        entries.append(_Tensor(f"{prefix}embed_tokens.weight", "model.embed_tokens.weight"))
    for index in layout.layers:
        entries += _layer_entries(spec, index, prefix)
    if layout.is_last:
        entries.append(_Tensor(f"{prefix}norm.weight", "model.norm.weight"))
        match head:
            case "causal_lm":
                source = f"{prefix}embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
                entries.append(_Tensor(source, "lm_head.weight"))
            case "sequence_classification":
                entries.append(_Tensor("score.weight", "score.classifier.weight"))
            case "embedding":
                pass
    return entries


def _from_hf(entry: _Entry) -> StateMapper:
    match entry:
        case _Tensor():
            return RenameMapper(entry.hf, entry.d9d)
        case _Experts():
            # per expert (out, in) -> stacked (E, out, in) -> (E, in, out)
            return SequentialMapper(
                [StackMapper(entry.hf, entry.d9d), TransposeMapper(entry.d9d, dim0=1, dim1=2, ndim=3)]
            )


def _to_hf(entry: _Entry) -> StateMapper:
    match entry:
        case _Tensor():
            return RenameMapper(entry.d9d, entry.hf)
        case _Experts():
            return SequentialMapper(
                [TransposeMapper(entry.d9d, dim0=1, dim1=2, ndim=3), UnstackMapper(entry.d9d, entry.hf)]
            )


def qwen3_load_mapper(
    spec: Qwen3Spec,
    head: HeadName,
    *,
    source_names: Collection[str],
    target_names: Collection[str],
) -> StateMapper:
    """HF checkpoint -> the state of one stage (``target_names``, its ``state_dict()`` keys).

    The graph covers the whole checkpoint and keeps only this stage's outputs, so a stage reads
    only its own tensors while strict validation still accounts for every checkpoint tensor. The
    checkpoint's backbone prefix (``model.`` or none) is taken from ``source_names``; head
    tensors the chosen head does not use (an ``lm_head.weight`` when classifying, a tied copy)
    are dropped unread.
    """
    prefix = "model." if any(name.startswith("model.") for name in source_names) else ""
    whole = StageLayout(layers=range(spec.num_layers), is_first=True, is_last=True)
    entries = _entries(spec, head, whole, prefix)
    consumed: set[str] = set()
    for entry in entries:
        match entry:
            case _Tensor():
                consumed.add(entry.hf)
            case _Experts():
                consumed.update(entry.hf)
    unused_heads = [name for name in HF_HEAD_TENSORS if name in source_names and name not in consumed]
    mappers = [_from_hf(entry) for entry in entries]
    if unused_heads:
        mappers.append(DropMapper(unused_heads))
    wanted = frozenset(target_names)
    return FilterMapper(ParallelMapper(mappers), lambda name: name in wanted)


def qwen3_export_mapper(spec: Qwen3Spec, head: HeadName, layout: StageLayout) -> StateMapper:
    """The state of one stage -> HF tensors named as transformers writes them for ``head``.

    A tied ``lm_head.weight`` is not written (transformers re-ties it from the embedding).
    """
    prefix = hf_prefix(head)
    mappers: list[StateMapper] = []
    for entry in _entries(spec, head, layout, prefix):
        if isinstance(entry, _Tensor) and entry.d9d == "lm_head.weight" and spec.tie_word_embeddings:
            mappers.append(DropMapper([entry.d9d]))
        else:
            mappers.append(_to_hf(entry))
    return ParallelMapper(mappers)
