"""Qwen3 and Qwen3-MoE: the family's config.json, decoder layer and name table.

The models, loading, parallelism and the provider are the decoder core's, shared by every
family; the ``Qwen3*`` names of those (``Qwen3CausalLM``, ``Qwen3Inputs``, ``build_qwen3``, ...)
are the core's objects under the names this module has always exported.
"""

from typing import TYPE_CHECKING

from d9d.hf._decoder import DecoderBackbone as Qwen3Backbone
from d9d.hf._decoder import DecoderCausalLM as Qwen3CausalLM
from d9d.hf._decoder import DecoderEmbedding as Qwen3Embedding
from d9d.hf._decoder import DecoderInputs as Qwen3Inputs
from d9d.hf._decoder import DecoderModelBase as Qwen3ModelBase
from d9d.hf._decoder import DecoderSequenceClassification as Qwen3SequenceClassification
from d9d.hf._decoder import (
    StageHandoff,
    StageLayout,
    causal_lm_targets,
    check_checkpoint,
    export_config,
    head_of,
    stage_layout,
    write_config,
)
from d9d.hf._decoder import build_decoder as build_qwen3
from d9d.hf._decoder import decoder_export_mapper as qwen3_export_mapper
from d9d.hf._decoder import decoder_load_mapper as qwen3_load_mapper
from d9d.hf._decoder import load_weights as load_qwen3_weights
from d9d.hf._decoder import parallelize_decoder as parallelize_qwen3
from d9d.hf._decoder import parallelize_decoder_tensor_parallel as parallelize_qwen3_tensor_parallel
from d9d.hf.qwen3._config import (
    Qwen3Config,
    Qwen3DenseConfig,
    Qwen3MoeConfig,
    hf_architecture,
    qwen3_spec,
    read_qwen3_config,
)
from d9d.hf.qwen3._decoder_layer import Qwen3DecoderLayer
from d9d.hf.qwen3._spec import Qwen3MoeSpec, Qwen3Spec

if TYPE_CHECKING:
    from d9d.hf._provider import HFModelProvider as Qwen3ModelProvider


def __getattr__(name: str) -> object:
    # The provider reads config.json of any family through d9d.hf's dispatch module, which
    # imports this package: imported here on first use, so that neither import needs the other
    # to have finished.
    if name == "Qwen3ModelProvider":
        from d9d.hf._provider import HFModelProvider

        return HFModelProvider
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Qwen3Backbone",
    "Qwen3CausalLM",
    "Qwen3Config",
    "Qwen3DecoderLayer",
    "Qwen3DenseConfig",
    "Qwen3Embedding",
    "Qwen3Inputs",
    "Qwen3ModelBase",
    "Qwen3ModelProvider",
    "Qwen3MoeConfig",
    "Qwen3MoeSpec",
    "Qwen3SequenceClassification",
    "Qwen3Spec",
    "StageHandoff",
    "StageLayout",
    "build_qwen3",
    "causal_lm_targets",
    "check_checkpoint",
    "export_config",
    "head_of",
    "hf_architecture",
    "load_qwen3_weights",
    "parallelize_qwen3",
    "parallelize_qwen3_tensor_parallel",
    "qwen3_export_mapper",
    "qwen3_load_mapper",
    "qwen3_spec",
    "read_qwen3_config",
    "stage_layout",
    "write_config",
]
