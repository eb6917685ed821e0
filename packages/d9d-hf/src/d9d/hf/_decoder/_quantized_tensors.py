"""MXFP4-quantized checkpoint tensors, dequantized at load: a ``X_blocks`` / ``X_scales`` pair reads as ``X``.

The pairs are found and checked from the headers (before any weight is read); ``mxfp4_mapper``
turns each pair into its bf16 tensor as the checkpoint streams, one pair at a time, reading only
the experts a rank holds; every other tensor passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from d9d.hf._decoder._mxfp4 import BLOCK_BYTES, dequantize_mxfp4
from d9d.state_mappers import (
    Box,
    GroupPlan,
    IdentityMapper,
    MapperGroup,
    ParallelMapper,
    SafetensorsCheckpoint,
    StateMapper,
    TensorPiece,
    TensorSpec,
)

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
DEQUANTIZED_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Mxfp4Pair:
    """One quantized tensor: ``name`` stored as ``name_blocks`` and ``name_scales``."""

    name: str

    @property
    def blocks(self) -> str:
        """The packed FP4 values' tensor name."""
        return self.name + BLOCKS_SUFFIX

    @property
    def scales(self) -> str:
        """The block exponents' tensor name."""
        return self.name + SCALES_SUFFIX


def mxfp4_pairs(checkpoint: SafetensorsCheckpoint) -> list[Mxfp4Pair]:
    """Every MXFP4 pair of the checkpoint, checked from its headers.

    Raises:
        ValueError: Naming the file and tensor of a ``*_blocks`` without its ``*_scales`` (or the
            reverse), a pair whose shapes or dtypes do not fit, or a pair beside a plain tensor
            of the same name.
    """
    specs = checkpoint.specs
    pairs: list[Mxfp4Pair] = []
    for name in sorted(specs):
        for suffix, other in ((BLOCKS_SUFFIX, SCALES_SUFFIX), (SCALES_SUFFIX, BLOCKS_SUFFIX)):
            base = name.removesuffix(suffix)
            if base != name and base + other not in specs:
                raise ValueError(
                    f"{checkpoint.file_of(name)}: tensor {name!r} is half of an MXFP4 pair whose "
                    f"{base + other!r} the checkpoint does not hold"
                )
        if not name.endswith(BLOCKS_SUFFIX):
            continue
        pair, file = Mxfp4Pair(name=name.removesuffix(BLOCKS_SUFFIX)), checkpoint.file_of(name)
        _check_pair(pair, specs[pair.blocks], specs[pair.scales], where=f"{file}: ")
        if pair.name in specs:
            raise ValueError(f"{file}: tensor {pair.name!r} is stored both plain and as an MXFP4 pair")
        pairs.append(pair)
    return pairs


def _check_pair(pair: Mxfp4Pair, blocks: TensorSpec, scales: TensorSpec, *, where: str = "") -> None:
    """Raises unless ``blocks`` and ``scales`` are an MXFP4 pair's specs (``where`` starts the message)."""
    fits = (
        blocks.dtype == torch.uint8
        and scales.dtype == torch.uint8
        and len(blocks.shape) == 4
        and blocks.shape[-1] == BLOCK_BYTES
        and tuple(blocks.shape[:-1]) == tuple(scales.shape)
    )
    if not fits:
        raise ValueError(
            f"{where}tensor {pair.blocks!r} {blocks.dtype} {list(blocks.shape)} and "
            f"{pair.scales!r} {scales.dtype} {list(scales.shape)} are not an MXFP4 pair (uint8 "
            f"blocks (experts, rows, G, {BLOCK_BYTES}) and uint8 scales (experts, rows, G))"
        )


def dequantized_spec(blocks: TensorSpec) -> TensorSpec:
    """The spec of the tensor a pair whose blocks are ``blocks`` dequantizes to: ``(E, G * 32, rows)``."""
    experts, rows, groups, _ = blocks.shape
    return TensorSpec(shape=(experts, groups * 2 * BLOCK_BYTES, rows), dtype=DEQUANTIZED_DTYPE)


def dequantized_specs(checkpoint: SafetensorsCheckpoint) -> dict[str, TensorSpec]:
    """The checkpoint's specs as loading sees them: each MXFP4 pair replaced by its bf16 tensor."""
    specs = checkpoint.specs
    for pair in mxfp4_pairs(checkpoint):
        specs[pair.name] = dequantized_spec(specs.pop(pair.blocks))
        del specs[pair.scales]
    return specs


def file_of(checkpoint: SafetensorsCheckpoint, name: str) -> Path:
    """The file holding ``name``, or its ``*_blocks`` for a dequantized pair."""
    return checkpoint.file_of(name if name in checkpoint.specs else name + BLOCKS_SUFFIX)


def mxfp4_mapper(checkpoint: SafetensorsCheckpoint) -> StateMapper:
    """The checkpoint's tensors under ``dequantized_specs``' names: pairs dequantized, the rest unchanged."""
    pairs = mxfp4_pairs(checkpoint)
    quantized = {name for pair in pairs for name in (pair.blocks, pair.scales)}
    plain = [IdentityMapper(name) for name in sorted(checkpoint.specs) if name not in quantized]
    return ParallelMapper([*(Mxfp4Mapper(pair.name) for pair in pairs), *plain])


class Mxfp4Mapper(MapperGroup):
    """``name_blocks`` + ``name_scales`` -> ``name`` in bf16 (``dequantize_mxfp4``).

    A slice of the output reads the slice of experts it needs whole: expert-sharded loads read
    only their experts' bytes.
    """

    def __init__(self, name: str) -> None:
        self._pair = Mxfp4Pair(name=name)

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset((self._pair.blocks, self._pair.scales))

    @property
    def outputs(self) -> frozenset[str]:
        return frozenset((self._pair.name,))

    def infer(self, input_specs: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        blocks, scales = input_specs[self._pair.blocks], input_specs[self._pair.scales]
        _check_pair(self._pair, blocks, scales)
        return {self._pair.name: dequantized_spec(blocks)}

    def plan(self, input_specs: Mapping[str, TensorSpec], output_boxes: Mapping[str, Box]) -> GroupPlan:
        pair = self._pair
        if pair.name not in output_boxes:
            return GroupPlan()
        out_box = output_boxes[pair.name]
        experts = out_box[0]
        blocks_box = (experts, *((0, n) for n in input_specs[pair.blocks].shape[1:]))
        scales_box = (experts, *((0, n) for n in input_specs[pair.scales].shape[1:]))

        def run(pieces: Mapping[str, TensorPiece]) -> dict[str, torch.Tensor]:
            whole = dequantize_mxfp4(
                pieces[pair.blocks].narrow(blocks_box), pieces[pair.scales].narrow(scales_box)
            )
            (r0, r1), (c0, c1) = out_box[1], out_box[2]
            return {pair.name: whole[:, r0:r1, c0:c1].contiguous()}

        return GroupPlan(input_boxes={pair.blocks: blocks_box, pair.scales: scales_box}, run=run)
