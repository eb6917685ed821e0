"""Refusing quantized checkpoints: d9d loads floating-point tensors only."""

from __future__ import annotations

from d9d.state_mappers import SafetensorsCheckpoint

QUANTIZED_SUFFIXES = ("_blocks", "_scales")
"""Name endings of MXFP4-quantized tensors (GPT-OSS's ``gate_up_proj_blocks`` / ``_scales``)."""


def refuse_quantized_tensors(checkpoint: SafetensorsCheckpoint) -> None:
    """Raises naming the file and the first tensor whose name marks it MXFP4-quantized.

    Reads headers only, before any weight is read.
    """
    for name in sorted(checkpoint.specs):
        if name.endswith(QUANTIZED_SUFFIXES):
            raise ValueError(
                f"{checkpoint.file_of(name)}: tensor {name!r} is MXFP4-quantized (a *_blocks / *_scales "
                "pair), which d9d does not dequantize; load a bf16 checkpoint (for example one saved by "
                "transformers after loading with Mxfp4Config(dequantize=True))"
            )
