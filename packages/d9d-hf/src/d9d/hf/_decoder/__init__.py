"""The family-agnostic decoder core of d9d.hf: every family's models, loading, parallelism, export."""

from d9d.hf._decoder._backbone import DecoderBackbone
from d9d.hf._decoder._checkpoint import (
    base_state_module,
    check_checkpoint,
    export_config,
    export_mapper_of,
    head_files,
)
from d9d.hf._decoder._config_base import DecoderConfigBase
from d9d.hf._decoder._config_file import CONFIG_FILE, read_config_file, write_config
from d9d.hf._decoder._config_with_head_dim import DecoderConfigWithHeadDim
from d9d.hf._decoder._decoder_layer import DecoderLayer
from d9d.hf._decoder._family import (
    DecoderFamily,
    FusedTensor,
    InterleavedTensor,
    LayerTensor,
    StackedExperts,
    TensorName,
)
from d9d.hf._decoder._heads import (
    ClassificationHeadSpec,
    DecoderHead,
    EmbeddingHeadSpec,
    HeadSpec,
    LanguageModelHeadSpec,
    SequenceClassificationHeadSpec,
    check_head_specs,
    head_file_names,
    head_named,
)
from d9d.hf._decoder._inputs import (
    DecoderInputs,
    StageHandoff,
    causal_lm_targets,
    check_padding_at_row_ends,
    resolve_positions,
)
from d9d.hf._decoder._latent_attention_plan import LatentAttentionDecoderPlan
from d9d.hf._decoder._layer_builder import build_layer
from d9d.hf._decoder._layer_names import attention_names, dense_mlp_names, same_names
from d9d.hf._decoder._layer_recipe import FeedForwardActivation, LayerRecipe, NormLayout, QkNorm
from d9d.hf._decoder._layer_windows import LayerType, layer_windows, resolve_layer_types
from d9d.hf._decoder._model import DecoderCausalLM, DecoderModel, MultiHeadOutput, build_decoder
from d9d.hf._decoder._parallelize import FsdpSettings, parallelize_decoder
from d9d.hf._decoder._spec import DecoderSpec
from d9d.hf._decoder._stage import StageLayout, stage_layout
from d9d.hf._decoder._stage_loading import (
    load_stage_from_checkpoint,
    load_weights,
    loaded_heads,
    stage_load_mapper,
)
from d9d.hf._decoder._state_mapper import decoder_export_mapper, decoder_load_mapper
from d9d.hf._decoder._tensor_parallel import parallelize_decoder_tensor_parallel, tensor_parallel_plan_of
from d9d.hf._decoder._tensor_parallel_plan import (
    DecoderTensorParallelPlan,
    MegatronDecoderPlan,
    TensorParallelRefusal,
)

__all__ = [
    "FsdpSettings",
    "CONFIG_FILE",
    "ClassificationHeadSpec",
    "DecoderBackbone",
    "DecoderCausalLM",
    "DecoderConfigBase",
    "DecoderConfigWithHeadDim",
    "DecoderFamily",
    "DecoderInputs",
    "DecoderLayer",
    "DecoderHead",
    "DecoderModel",
    "DecoderSpec",
    "DecoderTensorParallelPlan",
    "EmbeddingHeadSpec",
    "FeedForwardActivation",
    "FusedTensor",
    "HeadSpec",
    "InterleavedTensor",
    "LanguageModelHeadSpec",
    "LatentAttentionDecoderPlan",
    "LayerRecipe",
    "LayerTensor",
    "LayerType",
    "MegatronDecoderPlan",
    "MultiHeadOutput",
    "NormLayout",
    "QkNorm",
    "SequenceClassificationHeadSpec",
    "StackedExperts",
    "StageHandoff",
    "StageLayout",
    "TensorName",
    "TensorParallelRefusal",
    "attention_names",
    "base_state_module",
    "build_decoder",
    "build_layer",
    "causal_lm_targets",
    "check_checkpoint",
    "check_padding_at_row_ends",
    "check_head_specs",
    "decoder_export_mapper",
    "decoder_load_mapper",
    "dense_mlp_names",
    "export_config",
    "export_mapper_of",
    "head_file_names",
    "head_files",
    "head_named",
    "layer_windows",
    "load_stage_from_checkpoint",
    "load_weights",
    "loaded_heads",
    "parallelize_decoder",
    "parallelize_decoder_tensor_parallel",
    "read_config_file",
    "resolve_layer_types",
    "resolve_positions",
    "same_names",
    "stage_layout",
    "stage_load_mapper",
    "tensor_parallel_plan_of",
    "write_config",
]
