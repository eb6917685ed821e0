"""The heads of a decoder model: each head object owns its tensors, their Hugging Face names, its
fresh initialization and its output; a model is one backbone plus a sequence of them.

A model is ``DecoderModel(config, heads)``; a single-head model is the one-element case. The
core never asks which kind a head is: it calls these methods (``DecoderHead``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from safetensors.torch import save
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.hf._decoder._auxiliary_loss import attach_to_target_losses
from d9d.hf._decoder._inputs import DecoderInputs, StageHandoff, handoff_labels
from d9d.hf._decoder._spec import DecoderSpec
from d9d.hf._head import HeadName
from d9d.kernels.layers import ClassificationHead, EmbeddingHead, LanguageModelHead
from d9d.state_mappers import SafetensorsCheckpoint


class DecoderHead(Protocol):
    """One head on the last pipeline stage of a decoder model (see the module).

    Its module lives at ``module_path`` in the model, so its state names are
    ``<module_path>.<tensor>``; ``hf_tensors`` names them in a transformers checkpoint.
    """

    @property
    def name(self) -> str:
        """The head's name: its key in a several-head model's output dict."""
        ...

    @property
    def module_path(self) -> str:
        """Where its module lives in the model (``lm_head``, ``heads.<name>``, ...)."""
        ...

    @property
    def transformers_head(self) -> HeadName | None:
        """The transformers model its tensors are exported with, None when exported beside it."""
        ...

    def build(self, spec: DecoderSpec) -> nn.Module:
        """Its module (tensors on the current default device)."""
        ...

    def hf_tensors(self, prefix: str, spec: DecoderSpec) -> list[tuple[str, str]]:
        """``(checkpoint name, state name)`` of its tensors in a transformers checkpoint whose
        backbone names start with ``prefix``; empty for a head exported beside it."""
        ...

    def exported_state(self, spec: DecoderSpec) -> list[str]:
        """Its state names a transformers export leaves out (a tied or separately saved head)."""
        ...

    def loads_from(self, names: Collection[str], spec: DecoderSpec) -> bool:
        """Whether a checkpoint with tensors ``names`` gives it its values."""
        ...

    def saved_file(
        self, checkpoint: SafetensorsCheckpoint, spec: DecoderSpec
    ) -> SafetensorsCheckpoint | None:
        """Its own file beside ``checkpoint`` (an earlier export), or None."""
        ...

    def export_files(self, module: nn.Module, spec: DecoderSpec) -> dict[str, bytes]:
        """Files of an export beside the transformers directory (collective when sharded)."""
        ...

    def ties_embedding(self, spec: DecoderSpec) -> bool:
        """Whether it shares its weight with the token embedding (``tie_word_embeddings``)."""
        ...

    def tie(self, module: nn.Module, embedding: nn.Module | None, spec: DecoderSpec) -> None:
        """Re-establishes a weight shared with the token embedding (when both are on the stage)."""
        ...

    def reset(self, module: nn.Module) -> None:
        """Its fresh initialization (a tied weight keeps the embedding's values)."""
        ...

    def prepare(self, inputs: DecoderInputs, spec: DecoderSpec) -> DecoderInputs:
        """Completes a first-stage batch before it enters the model."""
        ...

    def output(self, module: nn.Module, handoff: StageHandoff) -> torch.Tensor:
        """Its output on the last stage's hand-off (final normalized hidden states)."""
        ...

    def with_auxiliary(
        self, output: torch.Tensor, auxiliary: torch.Tensor, handoff: StageHandoff
    ) -> torch.Tensor:
        """``output`` whose backward adds the auxiliary (load-balancing) loss's gradient."""
        ...


_M = TypeVar("_M", bound=nn.Module)


def _typed(module: nn.Module, kind: type[_M], head: str) -> _M:
    if not isinstance(module, kind):
        raise TypeError(f"head {head!r} holds a {type(module).__name__}, not a {kind.__name__}")
    return module


class _HeadDefaults:
    """What a head without that concern does: nothing tied, nothing saved beside the export, the
    batch unchanged, the auxiliary loss added with weight 1."""

    def exported_state(self, spec: DecoderSpec) -> list[str]:
        """Nothing left out of the transformers export."""
        del spec
        return []

    def saved_file(
        self, checkpoint: SafetensorsCheckpoint, spec: DecoderSpec
    ) -> SafetensorsCheckpoint | None:
        """None: no file of its own."""
        del checkpoint, spec
        return None

    def export_files(self, module: nn.Module, spec: DecoderSpec) -> dict[str, bytes]:
        """None: no file of its own."""
        del module, spec
        return {}

    def ties_embedding(self, spec: DecoderSpec) -> bool:
        """False."""
        del spec
        return False

    def tie(self, module: nn.Module, embedding: nn.Module | None, spec: DecoderSpec) -> None:
        """Nothing shared."""
        del module, embedding, spec

    def prepare(self, inputs: DecoderInputs, spec: DecoderSpec) -> DecoderInputs:
        """Unchanged."""
        del spec
        return inputs

    def with_auxiliary(
        self, output: torch.Tensor, auxiliary: torch.Tensor, handoff: StageHandoff
    ) -> torch.Tensor:
        """Added with weight 1."""
        del handoff
        return attach_to_target_losses(output, auxiliary, None)


class _Classifier(_HeadDefaults):
    """A bias-free linear classifier of each row's last real token (``ClassificationHead``)."""

    name: str

    def _classes(self, spec: DecoderSpec) -> int:
        raise NotImplementedError

    def build(self, spec: DecoderSpec) -> nn.Module:
        """A ``ClassificationHead`` without bias."""
        return ClassificationHead(
            spec.hidden_size, self._classes(spec), pooling="last", bias=False, init_std=spec.initializer_range
        )

    def reset(self, module: nn.Module) -> None:
        """Normal with the config's ``initializer_range``."""
        _typed(module, ClassificationHead, self.name).reset_parameters()

    def prepare(self, inputs: DecoderInputs, spec: DecoderSpec) -> DecoderInputs:
        """Derives the pooling mask from ``pad_token_id`` when none is given."""
        pad = spec.pad_token_id
        if inputs.attention_mask is not None or pad is None:
            return inputs
        return dataclasses.replace(inputs, attention_mask=(inputs.input_ids != pad).to(torch.int64))

    def output(self, module: nn.Module, handoff: StageHandoff) -> torch.Tensor:
        """Class logits ``(batch, num_labels)``."""
        classify = _typed(module, ClassificationHead, self.name)
        hidden = handoff["hidden_states"]
        if hidden.is_meta:  # the pipeline's shape pass: pooling reads the mask's values
            return classify.classifier(hidden[:, -1])
        return classify(hidden, handoff.get("attention_mask"))


@dataclass(kw_only=True, frozen=True)
class LanguageModelHeadSpec(_HeadDefaults):
    """The next-token head (at most one per model): transformers' ``lm_head.weight``.

    Its output is per-token losses through the fused linear cross-entropy (needs
    ``DecoderInputs.labels``); tied to the embedding when the config says so.

    Attributes:
        name: The head's name (its key in the model's output dict).
    """

    name: str = "lm"

    @property
    def module_path(self) -> str:
        """``lm_head``."""
        return "lm_head"

    @property
    def transformers_head(self) -> HeadName:
        """``causal_lm``."""
        return "causal_lm"

    def build(self, spec: DecoderSpec) -> nn.Module:
        """A ``LanguageModelHead`` over the vocabulary (its logits times ``spec.logits_multiplier``)."""
        return LanguageModelHead(
            spec.hidden_size,
            spec.vocab_size,
            init_std=spec.initializer_range,
            logit_scale=spec.logits_multiplier,
        )

    def hf_tensors(self, prefix: str, spec: DecoderSpec) -> list[tuple[str, str]]:
        """``lm_head.weight`` (the embedding's tensor when tied)."""
        source = f"{prefix}embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        return [(source, "lm_head.weight")]

    def exported_state(self, spec: DecoderSpec) -> list[str]:
        """A tied weight is not written (transformers re-ties it)."""
        return ["lm_head.weight"] if spec.tie_word_embeddings else []

    def loads_from(self, names: Collection[str], spec: DecoderSpec) -> bool:
        """Tied, or the checkpoint has ``lm_head.weight``."""
        return spec.tie_word_embeddings or "lm_head.weight" in names

    def ties_embedding(self, spec: DecoderSpec) -> bool:
        """The config's ``tie_word_embeddings``."""
        return spec.tie_word_embeddings

    def tie(self, module: nn.Module, embedding: nn.Module | None, spec: DecoderSpec) -> None:
        """Makes ``lm_head.weight`` the embedding's weight when tied."""
        if not spec.tie_word_embeddings or embedding is None:
            return
        weight = embedding.weight
        if not isinstance(weight, nn.Parameter):
            raise TypeError("the token embedding's weight is not a Parameter")
        _typed(module, LanguageModelHead, self.name).weight = weight

    def reset(self, module: nn.Module) -> None:
        """Normal with the config's ``initializer_range``."""
        _typed(module, LanguageModelHead, self.name).reset_parameters()

    def output(self, module: nn.Module, handoff: StageHandoff) -> torch.Tensor:
        """Per-token losses ``(batch, seq)``."""
        labels, summed = handoff_labels(handoff)
        if labels is None:
            raise ValueError(
                f"the causal_lm head {self.name!r} computes the loss and needs DecoderInputs.labels"
            )
        head = _typed(module, LanguageModelHead, self.name)
        return head(handoff["hidden_states"], labels, uniform_upstream_gradient=summed)

    def with_auxiliary(
        self, output: torch.Tensor, auxiliary: torch.Tensor, handoff: StageHandoff
    ) -> torch.Tensor:
        """Added as if to every target token's loss."""
        labels, _ = handoff_labels(handoff)
        return attach_to_target_losses(output, auxiliary, None if labels is None else labels != -100)


@dataclass(kw_only=True, frozen=True)
class SequenceClassificationHeadSpec(_Classifier):
    """transformers' ``*ForSequenceClassification`` head: ``score.weight``, logits of the last real token.

    The pooled token is the last one the ``attention_mask`` marks real, or without a mask the
    rightmost one that is not ``pad_token_id``; rows are one sequence each. A checkpoint without
    ``score.weight`` (a causal LM's) leaves it freshly initialized.

    Attributes:
        name: The head's name (its key in a several-head model's output dict).
        num_labels: Number of classes; None takes the config's (``num_labels`` or ``id2label``).
    """

    name: str = "score"
    num_labels: int | None = None

    @property
    def module_path(self) -> str:
        """``score``."""
        return "score"

    @property
    def transformers_head(self) -> HeadName:
        """``sequence_classification``."""
        return "sequence_classification"

    def _classes(self, spec: DecoderSpec) -> int:
        return spec.num_labels if self.num_labels is None else self.num_labels

    def hf_tensors(self, prefix: str, spec: DecoderSpec) -> list[tuple[str, str]]:
        """``score.weight``."""
        del prefix, spec
        return [("score.weight", "score.classifier.weight")]

    def loads_from(self, names: Collection[str], spec: DecoderSpec) -> bool:
        """The checkpoint has ``score.weight``."""
        del spec
        return "score.weight" in names


@dataclass(kw_only=True, frozen=True)
class EmbeddingHeadSpec(_HeadDefaults):
    """One L2-normalized vector per row, the last real token's (Qwen3-Embedding); no tensors.

    Attributes:
        name: The head's name (its key in a several-head model's output dict).
    """

    name: str = "embedding"

    @property
    def module_path(self) -> str:
        """``head``."""
        return "head"

    @property
    def transformers_head(self) -> HeadName:
        """``embedding`` (transformers' bare ``*Model``)."""
        return "embedding"

    def build(self, spec: DecoderSpec) -> nn.Module:
        """An ``EmbeddingHead`` (last-token pooling)."""
        return EmbeddingHead(spec.hidden_size, pooling="last")

    def hf_tensors(self, prefix: str, spec: DecoderSpec) -> list[tuple[str, str]]:
        """None."""
        del prefix, spec
        return []

    def loads_from(self, names: Collection[str], spec: DecoderSpec) -> bool:
        """Always (nothing to load)."""
        del names, spec
        return True

    def reset(self, module: nn.Module) -> None:
        """No parameters."""
        del module

    def output(self, module: nn.Module, handoff: StageHandoff) -> torch.Tensor:
        """Embeddings ``(batch, hidden)``."""
        head = _typed(module, EmbeddingHead, self.name)
        return head(handoff["hidden_states"], handoff.get("attention_mask"))


def head_file_names(name: str) -> tuple[str, str]:
    """The export's ``(tensors, config)`` file names of the classification head ``name``."""
    return f"head-{name}.safetensors", f"head-{name}.json"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the host (collective over its mesh when sharded)."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().cpu().contiguous()


@dataclass(kw_only=True, frozen=True)
class ClassificationHeadSpec(_Classifier):
    """A classification head beside other heads: ``heads.<name>``, saved as its own file.

    Loaded from ``head-<name>.safetensors`` beside the checkpoint (an earlier export, its
    ``head-<name>.json`` checked), else freshly initialized; exported as those two files.

    Attributes:
        name: The head's name (its key in the model's output dict and in ``heads``).
        num_labels: Number of classes.
    """

    name: str
    num_labels: int

    @property
    def module_path(self) -> str:
        """``heads.<name>``."""
        return f"heads.{self.name}"

    @property
    def transformers_head(self) -> None:
        """None: exported beside the transformers model."""
        return None

    def _classes(self, spec: DecoderSpec) -> int:
        del spec
        return self.num_labels

    def hf_tensors(self, prefix: str, spec: DecoderSpec) -> list[tuple[str, str]]:
        """None in the transformers checkpoint."""
        del prefix, spec
        return []

    def exported_state(self, spec: DecoderSpec) -> list[str]:
        """Its tensor (saved as its own file)."""
        del spec
        return [f"{self.module_path}.classifier.weight"]

    def loads_from(self, names: Collection[str], spec: DecoderSpec) -> bool:
        """Never from the transformers checkpoint."""
        del names, spec
        return False

    def saved_file(
        self, checkpoint: SafetensorsCheckpoint, spec: DecoderSpec
    ) -> SafetensorsCheckpoint | None:
        """``head-<name>.safetensors`` beside the checkpoint, or None.

        Raises:
            ValueError: If the file's JSON config names another kind, class count or width.
        """
        weights, config_name = head_file_names(self.name)
        path = checkpoint.path
        directory: Path = path if path.is_dir() else path.parent
        if not (directory / weights).is_file():
            return None
        config_path = directory / config_name
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        wanted = {"kind": "classification", "num_labels": self.num_labels, "hidden_size": spec.hidden_size}
        wrong = {key: config.get(key) for key, value in wanted.items() if config.get(key) != value}
        if wrong:
            raise ValueError(f"{config_path}: head {self.name!r} needs {wanted}, the file says {wrong}")
        return SafetensorsCheckpoint(directory / weights)

    def export_files(self, module: nn.Module, spec: DecoderSpec) -> dict[str, bytes]:
        """``head-<name>.safetensors`` (state names ``classifier.weight``) and ``head-<name>.json``."""
        tensors = {name: _full(t) for name, t in module.state_dict().items()}
        weights, config_name = head_file_names(self.name)
        config: dict[str, Any] = {
            "kind": "classification",
            "name": self.name,
            "num_labels": self.num_labels,
            "hidden_size": spec.hidden_size,
            "pooling": "last",
            "bias": False,
            "dtype": str(tensors["classifier.weight"].dtype).removeprefix("torch."),
        }
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        return {weights: save(tensors), config_name: text.encode()}


HeadSpec = LanguageModelHeadSpec | ClassificationHeadSpec | SequenceClassificationHeadSpec | EmbeddingHeadSpec
"""The core's heads (any object fitting ``DecoderHead`` works too)."""


def head_named(head: HeadName) -> DecoderHead:
    """The one head of the ``model.head`` choice (``causal_lm`` and its siblings)."""
    match head:
        case "causal_lm":
            return LanguageModelHeadSpec()
        case "sequence_classification":
            return SequenceClassificationHeadSpec()
        case "embedding":
            return EmbeddingHeadSpec()


def export_head_of(heads: Sequence[DecoderHead]) -> HeadName:
    """The transformers model an export of ``heads`` is: the one exported with it (``causal_lm``,
    ``sequence_classification``), else ``embedding`` (the bare backbone)."""
    for head in heads:
        kind = head.transformers_head
        if kind is not None and kind != "embedding":
            return kind
    return "embedding"


def as_heads(heads: HeadName | Sequence[DecoderHead]) -> Sequence[DecoderHead]:
    """``heads``, a ``model.head`` choice taken as its one head."""
    return [head_named(heads)] if isinstance(heads, str) else heads


def check_head_specs(heads: Sequence[DecoderHead]) -> None:
    """Raises ``ValueError`` unless the heads are non-empty, uniquely named (names without dots)
    and at most one of them is exported as a transformers head (``lm_head`` or ``score``)."""
    if not heads:
        raise ValueError("a decoder model needs at least one head")
    names = [head.name for head in heads]
    if len(set(names)) != len(names):
        raise ValueError(f"head names must be unique, got {names}")
    for name in names:
        if not name or "." in name or "/" in name:
            raise ValueError(f"head name {name!r} must be non-empty, without '.' or '/'")
    paths = [head.module_path for head in heads]
    if len(set(paths)) != len(paths):
        raise ValueError(
            f"at most one head of each transformers kind (the export has one lm_head or score), got {names}"
        )
    exported = [head.name for head in heads if head.transformers_head not in (None, "embedding")]
    if len(exported) > 1:
        raise ValueError(f"at most one head exported as the transformers model's head, got {exported}")
