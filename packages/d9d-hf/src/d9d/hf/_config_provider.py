"""The model provider of a job's config, for tools that read the config without running it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter

from d9d.hf._model_config import HFModelConfig
from d9d.hf._provider import HFModelProvider


def provider_from_config(config: Mapping[str, Any]) -> HFModelProvider:
    """The provider of the config's ``model`` section, any family (``d9d export``'s default ``--provider``).

    Args:
        config: The job's whole YAML config as a mapping.

    Raises:
        ValueError: If there is no ``model`` section or it does not validate.
    """
    section = config.get("model")
    if section is None:
        raise ValueError(
            "no model section (e.g. model: {source: Qwen/Qwen3-0.6B}); a job that builds its model "
            "in code names its provider with --provider module:function"
        )
    return HFModelProvider(TypeAdapter[HFModelConfig](HFModelConfig).validate_python(section))
