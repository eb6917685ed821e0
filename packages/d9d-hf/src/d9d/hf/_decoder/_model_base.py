"""What every decoder model (any family, any head) shares: config, stage layout, backbone, hand-off."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.func import functional_call

from d9d.hf._decoder._auxiliary_loss import (
    LOAD_BALANCING_KEY,
    add_stage_share,
    attach_to_target_losses,
    pooled_loss_of_rows,
)
from d9d.hf._decoder._backbone import DecoderBackbone
from d9d.hf._decoder._family import DecoderFamily
from d9d.hf._decoder._inputs import DecoderInputs, StageHandoff
from d9d.hf._decoder._stage import stage_layout
from d9d.kernels.layers import AttentionBackend, AttentionBackendName
from d9d.parallel import cast_parameters_for_compute
from d9d.pipeline import PipelineStageInfo


class DecoderModelBase(nn.Module):
    """A decoder backbone of one pipeline stage, of the family ``config`` names; subclasses add the head.

    Forward contract (d9d-loop's ``forward(inputs, shared)``): the first stage takes
    ``DecoderInputs``, every other stage the ``StageHandoff`` dict the previous stage returned; a
    non-last stage returns a ``StageHandoff``, the last stage its head's output.

    Args:
        config: The model's config.json, a family's config model (kept for export).
        stage: The pipeline stage to build; None builds the whole model.
        layers: Decoder layers of this stage; by default an even split (``layers_of_stage``).
        activation_checkpointing: Recompute every decoder layer in backward.
        attention_backend: Attention implementation (name or object); None auto-detects.
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
        super().__init__()
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
        self._layers_as_identity = False
        # The dtype forward computes in when it differs from the parameters' (FSDP mixed
        # precision casts them); set by whoever parallelizes, read by ``pipeline_output_meta``.
        self.compute_dtype: torch.dtype | None = None
        # The groups of the ranks holding the other parts of a microbatch step (data and context
        # parallel): the load-balancing statistics are summed over them before the pooled loss,
        # so it is the global microbatch's (``set_load_balancing_groups``).
        self.load_balancing_groups: tuple[ProcessGroup, ...] = ()

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

    def reset_parameters(self) -> None:
        """Re-initializes the backbone (heads extend this)."""
        self.model.reset_parameters()

    def tie_weights(self) -> None:
        """Re-establishes shared parameters (heads with tied weights override this)."""

    def reset_buffers(self) -> None:
        """After ``to_empty``: recomputes non-persistent buffers and re-ties shared parameters.

        Materializing a meta-device module gives every parameter a new object, which breaks
        sharing; loading a checkpoint then fills the parameters.
        """
        self.model.reset_buffers()
        self.tie_weights()

    def prepare_inputs(self, inputs: DecoderInputs) -> DecoderInputs:
        """First-stage hook: completes the batch before it enters the model (heads override)."""
        return inputs

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

    def attach_load_balancing_loss(self, output: torch.Tensor, handoff: StageHandoff) -> torch.Tensor:
        """The head's ``output``, whose backward adds the load-balancing loss's gradient (weight 1).

        For heads whose loss is not a per-token mean (the causal-LM head weights it by target).
        """
        auxiliary = self.load_balancing_loss(handoff)
        if auxiliary is None:
            return output
        return attach_to_target_losses(output, auxiliary, None)

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
        """Final normalized hidden states ``(batch, seq, hidden)`` of the whole model."""
        self.require_whole_model("hidden_states")
        inputs = DecoderInputs(
            input_ids=input_ids,
            document_ids=document_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
        )
        return self.run_backbone(inputs)["hidden_states"]
