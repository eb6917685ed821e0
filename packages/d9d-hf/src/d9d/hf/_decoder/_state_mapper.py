"""Hugging Face <-> d9d tensor names and layouts of decoder models, as state-mapper graphs.

The family's name table lists each decoder-layer tensor with the HF tensor(s) it comes from; the
core adds the embedding, the final norm and the head, and reads both directions off that table.
A ``StackedExperts`` row stores per expert ``(out, in)`` ``nn.Linear`` weights in the checkpoint
and one ``(E, in, out)`` tensor per projection in d9d; a ``FusedTensor`` row is one checkpoint
tensor (a fused QKV or gate/up projection) that d9d holds as separate tensors; an
``InterleavedTensor`` row one whose last dim interleaves them (GPT-OSS's experts).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from d9d.hf._decoder._family import (
    DecoderFamily,
    FusedTensor,
    InterleavedTensor,
    LayerTensor,
    StackedExperts,
    TensorName,
)
from d9d.hf._decoder._heads import DecoderHead, as_heads, export_head_of
from d9d.hf._decoder._stage import StageLayout
from d9d.hf._head import HeadName
from d9d.state_mappers import (
    ChunkMapper,
    ConcatenateMapper,
    DropMapper,
    FilterMapper,
    ParallelMapper,
    RenameMapper,
    ReshapeMapper,
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


@dataclass(frozen=True)
class _Fused:
    hf: str
    d9d: tuple[str, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class _Interleaved:
    hf: str
    d9d: tuple[str, ...]
    leading: tuple[int, ...]

    def parts(self) -> tuple[str, ...]:
        """Names of the parts between the chunk and the final reshape (the d9d names, marked)."""
        return tuple(f"{name}#interleaved" for name in self.d9d)


_Entry = _Tensor | _Experts | _Fused | _Interleaved


def hf_prefix(head: HeadName) -> str:
    """Prefix of backbone names in the checkpoint transformers writes for ``head``."""
    match head:
        case "causal_lm" | "sequence_classification":
            return "model."
        case "embedding":
            return ""


def _layer_entry(row: LayerTensor, hf: str, ours: str) -> _Entry:
    match row:
        case TensorName():
            return _Tensor(hf + row.hf, ours + row.d9d)
        case StackedExperts():
            return _Experts(tuple(hf + name for name in row.hf), ours + row.d9d)
        case FusedTensor():
            return _Fused(hf + row.hf, tuple(ours + name for name in row.d9d), row.sizes)
        case InterleavedTensor():
            return _Interleaved(hf + row.hf, tuple(ours + name for name in row.d9d), row.leading)


def _entries(
    family: DecoderFamily, heads: Sequence[DecoderHead], layout: StageLayout, prefix: str
) -> list[_Entry]:
    spec = family.decoder_spec()
    entries: list[_Entry] = []
    if layout.is_first:
        entries.append(_Tensor(f"{prefix}embed_tokens.weight", "model.embed_tokens.weight"))
    for index in layout.layers:
        hf, ours = f"{prefix}layers.{index}.", f"model.layers.{index}."
        entries += [_layer_entry(row, hf, ours) for row in family.layer_tensors(index)]
    if layout.is_last:
        entries.append(_Tensor(f"{prefix}norm.weight", "model.norm.weight"))
        for head in heads:
            entries += [_Tensor(hf, ours) for hf, ours in head.hf_tensors(prefix, spec)]
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
        case _Fused():
            return ChunkMapper(entry.hf, entry.d9d, dim=0, sizes=entry.sizes)
        case _Interleaved():
            leading, parts = entry.leading, entry.parts()
            return SequentialMapper(
                [
                    ReshapeMapper(entry.hf, (*leading, -1, len(parts))),
                    ChunkMapper(entry.hf, parts, dim=len(leading) + 1),
                    ParallelMapper(
                        [
                            ReshapeMapper(part, (*leading, -1), target=name)
                            for part, name in zip(parts, entry.d9d, strict=True)
                        ]
                    ),
                ]
            )


def _to_hf(entry: _Entry) -> StateMapper:
    match entry:
        case _Tensor():
            return RenameMapper(entry.d9d, entry.hf)
        case _Experts():
            return SequentialMapper(
                [TransposeMapper(entry.d9d, dim0=1, dim1=2, ndim=3), UnstackMapper(entry.d9d, entry.hf)]
            )
        case _Fused():
            return ConcatenateMapper(entry.d9d, entry.hf, dim=0)
        case _Interleaved():
            leading, parts = entry.leading, entry.parts()
            return SequentialMapper(
                [
                    ParallelMapper(
                        [
                            ReshapeMapper(name, (*leading, -1, 1), target=part)
                            for part, name in zip(parts, entry.d9d, strict=True)
                        ]
                    ),
                    ConcatenateMapper(parts, entry.hf, dim=len(leading) + 1),
                    ReshapeMapper(entry.hf, (*leading, -1)),
                ]
            )


def decoder_load_mapper(
    family: DecoderFamily,
    head: HeadName | Sequence[DecoderHead],
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

    Args:
        family: The model's config (its name table).
        head: The heads loaded from the checkpoint (or a ``model.head`` choice).
        source_names: The checkpoint's tensor names.
        target_names: The stage's state names to fill.
    """
    prefix = "model." if any(name.startswith("model.") for name in source_names) else ""
    whole = StageLayout(layers=range(family.decoder_spec().num_layers), is_first=True, is_last=True)
    entries = _entries(family, as_heads(head), whole, prefix)
    consumed: set[str] = set()
    for entry in entries:
        match entry:
            case _Tensor() | _Fused() | _Interleaved():
                consumed.add(entry.hf)
            case _Experts():
                consumed.update(entry.hf)
    unused_heads = [name for name in HF_HEAD_TENSORS if name in source_names and name not in consumed]
    mappers = [_from_hf(entry) for entry in entries]
    if unused_heads:
        mappers.append(DropMapper(unused_heads))
    wanted = frozenset(target_names)
    return FilterMapper(ParallelMapper(mappers), lambda name: name in wanted)


def decoder_export_mapper(
    family: DecoderFamily, head: HeadName | Sequence[DecoderHead], layout: StageLayout
) -> StateMapper:
    """The state of one stage -> HF tensors named as transformers writes them for its heads.

    A head's ``exported_state`` is not written: a tied ``lm_head.weight`` (transformers re-ties
    it from the embedding), a head saved as its own file.

    Args:
        family: The model's config (its name table).
        head: The stage's heads (or a ``model.head`` choice).
        layout: The stage's part of the model.
    """
    heads = as_heads(head)
    spec = family.decoder_spec()
    left_out = [name for one in heads for name in one.exported_state(spec)] if layout.is_last else []
    mappers: list[StateMapper] = [
        _to_hf(entry)
        for entry in _entries(family, heads, layout, hf_prefix(export_head_of(heads)))
        if not (isinstance(entry, _Tensor) and entry.d9d in left_out)
    ]
    if left_out:
        mappers.append(DropMapper(left_out))
    return ParallelMapper(mappers)
