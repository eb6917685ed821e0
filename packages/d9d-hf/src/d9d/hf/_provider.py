"""The ready d9d-loop model provider of every family: build, parallelize, load, export."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from d9d.hf._decoder import (
    DecoderFamily,
    DecoderModel,
    export_config,
    export_mapper_of,
    head_files,
    load_stage_from_checkpoint,
    parallelize_decoder,
    stage_load_mapper,
    tensor_parallel_plan_of,
)
from d9d.hf._decoder._auxiliary_loss import load_balancing_groups
from d9d.hf._decoder._expert_bias import (
    enable_expert_bias,
    expert_bias_names,
    update_expert_bias,
    zero_expert_bias,
)
from d9d.hf._families import as_family, read_decoder_config
from d9d.hf._float8_check import refuse_float8_converting_nothing
from d9d.hf._head import HeadName
from d9d.hf._hub import resolve_snapshot
from d9d.hf._master_dtype import cast_parameters_
from d9d.hf._memory_shape import family_config, memory_shape
from d9d.hf._model_config import Float8Config, HFModelConfig, PretrainedModelConfig, ScratchModelConfig
from d9d.hf._tied_stages import TiedStageCopies
from d9d.hf._tokenizer_files import tokenizer_files
from d9d.loop import (
    FinalizeGradientsContext,
    InitializeModelStageContext,
    InitializeModelStageResult,
    LoadModelStageContext,
    LoadModelStageResult,
    ModelProvider,
    OptimizerSteppedContext,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    StagesReadyContext,
    StagesReadyResult,
)
from d9d.loop.estimate import DescribeMemoryContext, DescribeMemoryResult
from d9d.mesh import DistributedContext
from d9d.parallel import Float8WeightCasts, precompute_float8_scales
from d9d.pipeline import layers_of_stage
from d9d.state_mappers import DropMapper, ParallelMapper, SafetensorsCheckpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, frozen=True)
class _Resolved:
    config: DecoderFamily
    checkpoint: SafetensorsCheckpoint | None
    files: dict[str, bytes]


def _files_of(directory: Path | None) -> dict[str, bytes]:
    if directory is None:
        return {}
    return tokenizer_files(directory)


def _expert_weight_casts(float8: Float8Config | None) -> Float8WeightCasts | None:
    if float8 is None:
        return None
    match float8.expert_weight_casts:
        case "per_microbatch":
            return None
        case "per_step":
            return Float8WeightCasts()


class HFModelProvider(ModelProvider[DecoderModel]):
    """Stages of any supported family for d9d-loop, from a checkpoint or freshly initialized.

    The family comes from config.json's ``model_type`` (the source's, or the ``config`` of a
    model pre-trained from scratch); everything else is the same for every family.

    With a ``source`` each stage reads only its own tensors, each rank only its slice of them
    (``load_model_stage``); a head the checkpoint lacks keeps its fresh initialization. Export
    writes config.json, the tensors under transformers' names and the source's tokenizer files.
    Under pipeline parallelism a tied embedding lives on the first and the last stage: a fresh
    last-stage copy takes the first stage's values (``stages_ready``), their gradients are summed
    every step (``finalize_gradients``), so both copies stay equal, and the last stage's copy is
    left out of the gradient norm (it counts once, as in one process).

    Every stage is a ``DecoderModel`` with the configured heads (``head``'s one head, or the
    ``heads`` list): they live on the last stage, each loads from the checkpoint (a
    language-model head also through its tie), a classification head of ``heads`` from its
    ``head-<name>.safetensors`` beside the checkpoint (an earlier export), or starts fresh; export
    adds ``head-<name>.safetensors`` and ``head-<name>.json`` per such head beside the
    transformers directory.

    Args:
        config: The ``model:`` section (``PretrainedModelConfig`` or ``ScratchModelConfig``).
    """

    def __init__(self, config: HFModelConfig) -> None:
        self._config = config
        self._resolved: _Resolved | None = None
        self._tied = TiedStageCopies()
        self._expert_weight_casts = _expert_weight_casts(config.float8)

    @property
    def head(self) -> HeadName:
        """The single head every stage is built with (``causal_lm`` by default; with ``heads`` set,
        the config's ``heads`` list describes the model instead)."""
        return self._config.head

    def model_config(self, dist_context: DistributedContext) -> DecoderFamily:
        """The config.json the model is built from (the source is fetched once, main rank first)."""
        return self._resolve(dist_context).config

    def _with_load_balancing(self, config: DecoderFamily) -> DecoderFamily:
        """``config`` with ``model.load_balancing_loss`` applied (None keeps config.json's choice)."""
        enabled = self._config.load_balancing_loss
        return config if enabled is None else config.with_output_router_logits(enabled)

    def _resolve(self, dist_context: DistributedContext) -> _Resolved:
        if self._resolved is not None:
            return self._resolved
        match self._config:
            case PretrainedModelConfig():
                with dist_context.main_process_first():  # one download per node, others hit the cache
                    directory = resolve_snapshot(self._config.source, revision=self._config.revision)
                config = read_decoder_config(directory)
                if self._config.num_labels is not None:
                    config = config.with_num_labels(self._config.num_labels)
                if self._config.pad_token_id is not None:
                    config = config.with_pad_token_id(self._config.pad_token_id)
                self._resolved = _Resolved(
                    config=self._with_load_balancing(config),
                    checkpoint=SafetensorsCheckpoint(directory),
                    files=_files_of(directory),
                )
            case ScratchModelConfig():
                self._resolved = _Resolved(
                    config=self._with_load_balancing(as_family(self._config.config)),
                    checkpoint=None,
                    files=_files_of(self._config.tokenizer),
                )
        return self._resolved

    def initialize_model_stage(
        self, context: InitializeModelStageContext
    ) -> InitializeModelStageResult[DecoderModel]:
        """Builds the stage's layers (on meta); with a source, checks its tensors' names and shapes.

        Raises:
            ValueError: Under ``tensor_parallel > 1`` for a family without a tensor-parallel plan,
                naming its ``model_type``, before any layer is built.
        """
        resolved = self._resolve(context.dist_context)
        # a family without a plan would keep its layers unsplit and fail at step 0 with a shape error
        tp = context.dist_context.parameters.tensor_parallel
        tensor_parallel_plan_of(resolved.config, tensor_parallel=tp)
        layers = layers_of_stage(
            context.stage,
            resolved.config.decoder_spec().num_layers,
            last_stage_weight=self._config.last_stage_weight,
        )
        model = DecoderModel(
            resolved.config,
            self._config.model_heads(),
            stage=context.stage,
            layers=layers,
            activation_checkpointing=self._config.activation_checkpointing,
            attention_backend=self._config.attention_backend,
        )
        if self._config.expert_bias_update_rate is not None:
            enable_expert_bias(model)  # before the load mapper: the checkpoint has no bias
        dtype = self._config.compute_dtype
        model.compute_dtype = None if dtype is None else _DTYPES[dtype]
        if self._config.master_dtype != "float32":
            cast_parameters_(model, _DTYPES[self._config.master_dtype])  # on meta: no copy
        checkpoint = resolved.checkpoint  # raises early on a misfit
        mapper = None if checkpoint is None else stage_load_mapper(model, checkpoint)
        return InitializeModelStageResult(model=model, state_mapper=mapper)

    def parallelize_model_stage(self, context: ParallelizeModelStageContext[DecoderModel]) -> None:
        """Applies FP8 (``float8``) and the decoder recipe (TP, CP, EP, FSDP/HSDP per ``fsdp``)."""
        float8 = self._config.float8
        if float8 is not None:
            refuse_float8_converting_nothing(context.model, float8, model_name=self._model_name())
        parallelize_decoder(
            context.model,
            dist_context=context.dist_context,
            param_dtype=context.model.compute_dtype,  # the config's param_dtype, set when built
            float8=None if float8 is None else float8.training(),
            float8_experts=float8 is not None and float8.experts,
            float8_expert_weight_casts=self._expert_weight_casts,
            fsdp=self._config.fsdp.settings(),
        )
        if self._config.compile:
            context.model.model.compile_layers()
        context.model.set_load_balancing_groups(load_balancing_groups(context.dist_context))

    def _model_name(self) -> str:
        match self._config:
            case PretrainedModelConfig():
                return self._config.source
            case ScratchModelConfig():
                return f"the {self._config.config.model_type} model built from model.config"

    def load_model_stage(self, context: LoadModelStageContext[DecoderModel]) -> LoadModelStageResult:
        """With a source: fresh initialization, then the checkpoint's tensors (this rank's slices)."""
        model = context.model
        model.reset_buffers()  # re-ties a head sharing the embedding (materializing split them)
        checkpoint = self._resolve(context.dist_context).checkpoint
        if checkpoint is None:
            return LoadModelStageResult(loaded=False)
        show_progress = context.dist_context.is_main_process
        load_stage_from_checkpoint(model, checkpoint, show_progress=show_progress)
        if not model.spec.checkpoint_expert_bias:
            zero_expert_bias(model)  # not in the checkpoint: left as materialized
        self._tied.mark_loaded()
        if self._expert_weight_casts is not None:
            self._expert_weight_casts.clear()
        return LoadModelStageResult(loaded=True)

    def describe_memory(self, context: DescribeMemoryContext) -> DescribeMemoryResult:
        """The model's shape from config.json alone (a Hub source fetches that file, no weights)."""
        del context
        return DescribeMemoryResult(shape=memory_shape(self._config, family_config(self._config)))

    def stages_ready(self, context: StagesReadyContext[DecoderModel]) -> StagesReadyResult:
        """Under PP with tied embeddings: copies the first stage's embedding to the last stage."""
        if not self._tied_across_stages(context.dist_context):
            return StagesReadyResult()
        return StagesReadyResult(norm_duplicates=self._tied.align(context.dist_context, context.stages))

    def _tied_across_stages(self, dist_context: DistributedContext) -> bool:
        if dist_context.parameters.pipeline_parallel == 1:
            return False
        heads = self._config.model_heads()
        heads = heads if isinstance(heads, list) else [heads]
        spec = self._resolve(dist_context).config.decoder_spec()
        return any(head.ties_embedding(spec) for head in heads)

    def finalize_gradients(self, context: FinalizeGradientsContext[DecoderModel]) -> None:
        """Sums the gradients of a tied embedding's two copies (first and last pipeline stage);
        moves the MoE selection biases by the step's token counts (``expert_bias_update_rate``);
        drops the FP8 experts' kept weight casts (the step's microbatches are done: the optimizer
        gets their memory)."""
        if self._expert_weight_casts is not None:
            self._expert_weight_casts.clear()
        rate = self._config.expert_bias_update_rate
        if rate is not None:
            update_expert_bias(context.dist_context, [model for _, model in context.stages], rate)
        if not self._tied_across_stages(context.dist_context):
            return
        self._tied.sum_gradients(context.dist_context, context.stages)

    def optimizer_stepped(self, context: OptimizerSteppedContext[DecoderModel]) -> None:
        """Drops the FP8 experts' kept weight casts (``expert_weight_casts: per_step``); with FSDP's
        float8 all-gather: the new weights' float8 scales, one all-reduce per stage."""
        if self._expert_weight_casts is not None:
            self._expert_weight_casts.clear()
        float8 = self._config.float8
        if float8 is None or not float8.fsdp_float8_all_gather:
            return
        for _, model in context.stages:
            precompute_float8_scales(model)

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext[DecoderModel]
    ) -> PrepareExportModelStageResult:
        """transformers' tensor names, config.json (from the first stage) and tokenizer files."""
        model = context.model
        resolved = self._resolve(context.dist_context)
        files = dict(resolved.files)
        if context.stage.is_first:
            dtype = next(model.parameters()).dtype
            files["config.json"] = (
                json.dumps(export_config(model, dtype), indent=2, sort_keys=True) + "\n"
            ).encode()
        mapper = export_mapper_of(model)
        files.update(head_files(model))  # collective over the stage's ranks
        # the job's biases are not exported; a family whose checkpoint holds them exports them
        biases = [] if model.spec.checkpoint_expert_bias else expert_bias_names(model)
        if biases:
            mapper = ParallelMapper([mapper, DropMapper(biases)])
        return PrepareExportModelStageResult(state_mapper=mapper, files=files)
