"""The decoder model of every family: one backbone and its heads (``DecoderHead`` objects)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.func import functional_call

from d9d.hf._decoder._auxiliary_loss import LOAD_BALANCING_KEY, add_stage_share, pooled_loss_of_rows
from d9d.hf._decoder._backbone import DecoderBackbone
from d9d.hf._decoder._family import DecoderFamily
from d9d.hf._decoder._heads import (
    DecoderHead,
    LanguageModelHeadSpec,
    check_head_specs,
    export_head_of,
    head_named,
)
from d9d.hf._decoder._inputs import DecoderInputs, StageHandoff, check_padding_at_row_ends
from d9d.hf._decoder._stage import stage_layout
from d9d.hf._head import HeadName
from d9d.kernels.layers import AttentionBackend, AttentionBackendName, LanguageModelHead
from d9d.parallel import cast_parameters_for_compute
from d9d.pipeline import PipelineStageInfo

MultiHeadOutput = dict[str, torch.Tensor]
"""The last stage's output of a model given a sequence of heads: per head name, its output (a
language-model head's per-token losses ``(batch, seq)``, a classification head's logits
``(batch, num_labels)``, an embedding head's vectors ``(batch, hidden)``)."""


def _check_mask(attention_mask: torch.Tensor | None) -> None:
    """The whole-model helpers' host check of the caller's ``attention_mask`` (if any)."""
    if attention_mask is not None:
        check_padding_at_row_ends(attention_mask)


def _install(model: nn.Module, path: str, module: nn.Module | None) -> None:
    """Registers ``module`` at the dotted ``path`` (a parent is a ``ModuleDict``, made on demand)."""
    parent_name, _, name = path.rpartition(".")
    if not parent_name:
        if module is not None or not hasattr(type(model), name):  # a typed property reads None itself
            setattr(model, name, module)
        return
    parent = dict(model.named_children()).get(parent_name)
    if parent is None:
        parent = nn.ModuleDict()
        setattr(model, parent_name, parent)
    if module is not None:
        parent.add_module(name, module)


class DecoderModel(nn.Module):
    """A decoder of the family ``config`` names, one pipeline stage of it: a backbone plus heads.

    Every head reads the final normalized hidden states on the last stage (``DecoderHead``: its
    module, Hugging Face names, fresh initialization and output are the head object's). Forward
    contract (d9d-loop's ``forward(inputs, shared)``): the first stage takes ``DecoderInputs``,
    every other stage the ``StageHandoff`` dict the previous stage returned; a non-last stage
    returns a ``StageHandoff``, the last stage the head's output (one head given) or every head's
    output by name (``MultiHeadOutput``, a sequence of heads given).

    On MoE layers whose objective has the load-balancing loss, it is attached once, to the first
    head's output (``DecoderHead.with_auxiliary``), so the task's weight of that loss scales it too.

    Tied embeddings (``tie_word_embeddings``): when one module holds both ends, ``lm_head.weight``
    *is* ``model.embed_tokens.weight``. Under pipeline parallelism the last stage holds its own
    copy, loaded from the same checkpoint tensor (``sum_tied_gradients``, ``broadcast_tied_weight``).

    Args:
        config: The model's config.json, a family's config model (kept for export).
        heads: One head, or several in output order (``check_head_specs``).
        stage: The pipeline stage to build; None builds the whole model.
        layers: Decoder layers of this stage; by default an even split (``layers_of_stage``).
        activation_checkpointing: Recompute every decoder layer in backward.
        attention_backend: Attention implementation (name or object); None auto-detects.
    """

    def __init__(
        self,
        config: DecoderFamily,
        heads: DecoderHead | Sequence[DecoderHead],
        *,
        stage: PipelineStageInfo | None = None,
        layers: range | None = None,
        activation_checkpointing: bool = False,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        super().__init__()
        self.head_specs: tuple[DecoderHead, ...] = tuple(heads) if isinstance(heads, Sequence) else (heads,)
        check_head_specs(self.head_specs)
        self._one_output = not isinstance(heads, Sequence)
        self.config = config
        self.spec = config.decoder_spec()
        self.layout = stage_layout(self.spec.num_layers, stage, layers)
        self.model = DecoderBackbone(
            config,
            self.spec,
            self.layout,
            activation_checkpointing=activation_checkpointing,
            attention_backend=attention_backend,
        )
        for head in self.head_specs:
            _install(self, head.module_path, head.build(self.spec) if self.layout.is_last else None)
        self.tie_weights()
        self._layers_as_identity = False
        # The dtype forward computes in when it differs from the parameters' (FSDP mixed
        # precision casts them); set by whoever parallelizes, read by ``pipeline_output_meta``.
        self.compute_dtype: torch.dtype | None = None
        # The groups of the ranks holding the other parts of a microbatch step (data and context
        # parallel): the load-balancing statistics are summed over them before the pooled loss,
        # so it is the global microbatch's (``set_load_balancing_groups``).
        self.load_balancing_groups: tuple[ProcessGroup, ...] = ()

    def head_modules(self) -> list[tuple[DecoderHead, nn.Module]]:
        """Every head with its module (empty off the last stage)."""
        if not self.layout.is_last:
            return []
        return [(head, self.get_submodule(head.module_path)) for head in self.head_specs]

    @property
    def lm_head(self) -> LanguageModelHead | None:
        """The language-model head's module on this stage, None elsewhere or without one."""
        module = dict(self.named_children()).get("lm_head")
        return module if isinstance(module, LanguageModelHead) else None

    @property
    def export_head(self) -> HeadName:
        """The transformers model an export is (``export_head_of``)."""
        return export_head_of(self.head_specs)

    def pipeline_output_meta(self, inputs: DecoderInputs | StageHandoff, shared: Any) -> Any:
        """The forward's output for meta ``inputs``, the decoder layers taken as identity.

        d9d-loop's ``StageOutputMeta``: MoE routing (token counts per expert) cannot run on the
        meta device, and every decoder layer keeps the residual stream's shape and dtype, so the
        embedding, hand-off and head alone give the output's structure, shapes and dtypes (in
        ``compute_dtype`` when set, as FSDP mixed precision computes).
        """
        # Under mixed precision the parameters are cast before forward: so are they here.
        hooks = [] if self.compute_dtype is None else cast_parameters_for_compute(self, self.compute_dtype)
        self._layers_as_identity = True
        try:
            if all(t.is_meta for t in chain(self.parameters(), self.buffers())):
                return self(inputs, shared)
            # a materialized stage (an executor used without d9d-loop's meta copy): meta stand-ins
            # for its tensors, so that nothing is computed and meta inputs meet meta weights
            state = {
                name: torch.empty_like(t, device="meta")
                for name, t in chain(
                    self.named_parameters(remove_duplicate=False), self.named_buffers(remove_duplicate=False)
                )
            }
            return functional_call(self, state, (inputs, shared))
        finally:
            for hook in hooks:
                hook.remove()
            self._layers_as_identity = False

    def set_load_balancing_groups(self, groups: tuple[ProcessGroup, ...]) -> None:
        """Sums the load-balancing statistics over ``groups`` (data- and context-parallel ranks).

        Each rank routes its own tokens; summed over the ranks that share a microbatch step, the
        statistics give the loss pooled over the global microbatch, as one process computes it
        on that batch (transformers' ``load_balancing_loss_func`` on the whole batch). The
        backward sums the gradients over the same groups. Every rank of a group must run the
        same schedule of microbatches (the last stage calls the collective once per microbatch).
        """
        self.load_balancing_groups = groups

    def set_overlap_point(self, point: Callable[[torch.Tensor], None] | None) -> None:
        """d9d-pipeline's ``OverlapPoints``: ``point`` runs after each decoder layer of the stage."""
        self.model.set_overlap_point(point)

    def reset_heads(self, heads: Sequence[DecoderHead] | None = None) -> None:
        """Fresh values for ``heads`` (default: every head), in head order, on the last stage."""
        for head, module in self.head_modules():
            if heads is None or head in heads:
                head.reset(module)

    def reset_parameters(self) -> None:
        """Re-initializes the heads, then the backbone (a tied head keeps the embedding's values)."""
        self.tie_weights()
        self.reset_heads()
        self.model.reset_parameters()

    def tie_weights(self) -> None:
        """Re-establishes the weights a head shares with the embedding (both on this stage)."""
        for head, module in self.head_modules():
            head.tie(module, self.model.embed_tokens, self.spec)

    def reset_buffers(self) -> None:
        """After ``to_empty``: recomputes non-persistent buffers and re-ties shared parameters.

        Materializing a meta-device module gives every parameter a new object, which breaks
        sharing; loading a checkpoint then fills the parameters.
        """
        self.model.reset_buffers()
        self.tie_weights()

    def prepare_inputs(self, inputs: DecoderInputs) -> DecoderInputs:
        """First-stage hook: each head completes the batch (a pooling mask from ``pad_token_id``)."""
        for head in self.head_specs:
            inputs = head.prepare(inputs, self.spec)
        return inputs

    def forward(
        self, inputs: DecoderInputs | StageHandoff, shared: Any = None
    ) -> torch.Tensor | MultiHeadOutput | StageHandoff:
        """The head's output (or every head's by name) on the last stage, the hand-off on the others.

        Args:
            inputs: ``DecoderInputs`` (with ``labels`` for a language-model head) on the first
                stage, the previous stage's hand-off on the others.
            shared: Unused (d9d-loop's shared forward argument).
        """
        del shared
        handoff = self.run_backbone(inputs)
        if not self.layout.is_last:
            return handoff
        outputs = self._head_outputs(handoff)
        return outputs[self.head_specs[0].name] if self._one_output else outputs

    def _head_outputs(self, handoff: StageHandoff) -> MultiHeadOutput:
        """Every head's output; the load-balancing loss rides on the first head's."""
        outputs = {head.name: head.output(module, handoff) for head, module in self.head_modules()}
        auxiliary = self.load_balancing_loss(handoff)
        first = self.head_specs[0]
        if auxiliary is not None:
            outputs[first.name] = first.with_auxiliary(outputs[first.name], auxiliary, handoff)
        return outputs

    def run_backbone(self, inputs: DecoderInputs | StageHandoff) -> StageHandoff:
        """Embeds (first stage) and runs this stage's layers; returns the hand-off."""
        if isinstance(inputs, DecoderInputs):
            if not self.layout.is_first:
                raise TypeError(
                    "a non-first stage takes the previous stage's hand-off dict, not DecoderInputs"
                )
            prepared = self.prepare_inputs(inputs)
            # attention honours the caller's mask only: a pooling mask a head derives from
            # pad_token_id picks the pooled token, as in transformers, and leaves attention alone
            handoff = prepared.handoff(
                self.model.embed(prepared.input_ids), padding_mask=inputs.attention_mask
            )
        else:
            if self.layout.is_first:
                raise TypeError("the first stage takes DecoderInputs, not a hand-off dict")
            handoff = inputs
        hidden = self.model(
            handoff["hidden_states"],
            position_ids=handoff["position_ids"],
            document_ids=handoff.get("document_ids"),
            # the load-balancing statistics leave padding out, as transformers' attention_mask does
            token_mask=handoff.get("attention_mask") if self.spec.load_balancing else None,
            run_layers=not self._layers_as_identity,
        )
        out = {**handoff, "hidden_states": hidden}
        if self.spec.load_balancing:  # the same keys in training and eval
            out[LOAD_BALANCING_KEY] = add_stage_share(
                handoff.get(LOAD_BALANCING_KEY),
                self.model.pop_load_balancing_statistics(),
                hidden.shape[0],
                2 * self.spec.num_experts + 1,
            )
        return out

    def load_balancing_loss(self, handoff: StageHandoff) -> torch.Tensor | None:
        """The weighted load-balancing loss pooled over every layer (last stage), None without one."""
        rows = handoff.get(LOAD_BALANCING_KEY)
        if rows is None or not rows.requires_grad:
            return None
        return pooled_loss_of_rows(rows, self.spec.load_balancing_coefficient, self.load_balancing_groups)

    def require_whole_model(self, what: str) -> None:
        """Raises unless this module is the whole model (first and last stage)."""
        if not (self.layout.is_first and self.layout.is_last):
            raise RuntimeError(f"{what} needs the whole model, this module is one pipeline stage")

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normalized hidden states ``(batch, seq, hidden)`` of the whole model.

        An ``attention_mask`` is checked here (``check_padding_at_row_ends``), reading it back
        from the device: these whole-model helpers take the user's tensors; the training forward
        takes batches checked where they were built.
        """
        self.require_whole_model("hidden_states")
        _check_mask(attention_mask)
        inputs = DecoderInputs(
            input_ids=input_ids,
            document_ids=document_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
        )
        return self.run_backbone(inputs)["hidden_states"]

    def _whole_output(self, inputs: DecoderInputs, what: str) -> torch.Tensor:
        """The one head's output of the whole model."""
        self.require_whole_model(what)
        if not self._one_output:
            raise TypeError(f"{what} needs a model built with one head; use outputs() for several")
        _check_mask(inputs.attention_mask)
        output = self(inputs)
        if not isinstance(output, torch.Tensor):
            raise TypeError("the whole model returned no tensor")
        return output

    def outputs(
        self,
        input_ids: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> MultiHeadOutput:
        """Every head's output by name, of the whole model (see ``forward``)."""
        self.require_whole_model("outputs")
        _check_mask(attention_mask)
        inputs = DecoderInputs(input_ids=input_ids, labels=labels, attention_mask=attention_mask)
        return self._head_outputs(self.run_backbone(inputs))

    def loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean next-token loss of a whole one-head causal-LM model over targets that are not ``-100``.

        Args:
            input_ids: ``(batch, seq)`` tokens.
            labels: ``(batch, seq)`` per-position targets (see ``causal_lm_targets``).
            document_ids: Packed-document ids.
            position_ids: Positions (restarting per document when packed).
            attention_mask: Nonzero on real tokens; attention skips padding (left or right).
        """
        inputs = DecoderInputs(
            input_ids=input_ids,
            labels=labels,
            document_ids=document_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            summed_losses=True,
        )
        losses = self._whole_output(inputs, "loss")
        return losses.sum() / (labels != -100).sum().clamp(min=1)

    def logits(
        self,
        input_ids: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits ``(batch, seq, vocab)`` of the whole model (for inference).

        ``attention_mask`` (nonzero on real tokens) makes attention skip padding, left or right.
        """
        lm_head = self.lm_head
        if lm_head is None:
            raise RuntimeError("logits needs the last stage of a model with a language-model head")
        hidden = self.hidden_states(
            input_ids, document_ids=document_ids, position_ids=position_ids, attention_mask=attention_mask
        )
        return lm_head.compute_logits(hidden)

    def classify(
        self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Class logits ``(batch, num_labels)`` of a whole one-head classification model."""
        return self._whole_output(
            DecoderInputs(input_ids=input_ids, attention_mask=attention_mask), "classify"
        )

    def embed(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings ``(batch, hidden)`` of a whole one-head embedding model."""
        return self._whole_output(DecoderInputs(input_ids=input_ids, attention_mask=attention_mask), "embed")


class DecoderCausalLM(DecoderModel):
    """``DecoderModel`` with the one language-model head (``LanguageModelHeadSpec``), the name the
    rollout engine (d9d-rl), the examples and users' code build a next-token model with.

    Args:
        config: The model's config.json (a family's config model).
        stage: The pipeline stage to build; None builds the whole model.
        layers: Decoder layers of this stage; by default an even split.
        activation_checkpointing: Recompute every decoder layer in backward.
        attention_backend: Attention implementation; None auto-detects.
    """

    def __init__(
        self,
        config: DecoderFamily,
        *,
        stage: PipelineStageInfo | None = None,
        layers: range | None = None,
        activation_checkpointing: bool = False,
        attention_backend: AttentionBackend | AttentionBackendName | None = None,
    ) -> None:
        super().__init__(
            config,
            LanguageModelHeadSpec(),
            stage=stage,
            layers=layers,
            activation_checkpointing=activation_checkpointing,
            attention_backend=attention_backend,
        )


def build_decoder(config: DecoderFamily, head: HeadName, **kwargs: Any) -> DecoderModel:
    """The one-head model of any family for a ``model.head`` choice (keyword arguments go to
    ``DecoderModel``)."""
    return DecoderModel(config, head_named(head), **kwargs)
