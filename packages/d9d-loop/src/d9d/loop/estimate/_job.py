"""A job's settings that its device memory follows, gathered from the config's sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from d9d.loop.config._optimizer import OptimizerConfig
from d9d.loop.estimate._shape import ModelMemoryShape
from d9d.loop.peft import FullFineTuningConfig, LoRAConfig, NF4BaseConfig, PeftConfig, PlainBaseConfig
from d9d.mesh import MeshParameters

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(kw_only=True, frozen=True)
class OptimizerMemory:
    """What the optimizer keeps per trained parameter.

    Attributes:
        state_bytes: Bytes of state per trained element (AdamW: two moments).
        offloaded: The state lives in host memory; the device holds only ``staging_bytes``.
        staging_bytes: Device bytes of the offloaded state's staging chunks (two in flight) and
            of the moments it keeps on the device (``resident_mib``).
        resident_bytes: Of those, the moments kept on the device (the host holds the rest).
    """

    state_bytes: int
    offloaded: bool = False
    staging_bytes: int = 0
    resident_bytes: int = 0


def optimizer_memory(config: OptimizerConfig, *, storage_bytes: int) -> OptimizerMemory:
    """The state of the configured optimizer; torch's optimizers keep it in the parameters' dtype.

    Args:
        config: The ``optimizer`` section.
        storage_bytes: Bytes per element of the stored (master) parameters.
    """
    match config.name:
        case "adamw" | "adam":
            return OptimizerMemory(state_bytes=2 * storage_bytes)
        case "sgd":
            return OptimizerMemory(state_bytes=storage_bytes if config.momentum > 0 else 0)
        case "stochastic_adamw":
            state = 2 * _DTYPE_BYTES[config.state_dtype]
            if config.offload is None:
                return OptimizerMemory(state_bytes=state)
            # two chunks in flight, and the moments kept on the device (at most: the estimate does not
            # know here whether the model's moments fill ``resident_mib``)
            resident = config.offload.resident_mib << 20
            staging = (2 * config.offload.chunk_mib << 20) + resident
            return OptimizerMemory(
                state_bytes=state, offloaded=True, staging_bytes=staging, resident_bytes=resident
            )


@dataclass(kw_only=True, frozen=True)
class MemoryJob:
    """Everything the estimate reads: the model's shape and the run's settings.

    Attributes:
        model: The provider's statement of the model.
        mesh: The parallelism degrees.
        sequence_length: Tokens per row.
        microbatch_size: Rows per microbatch (one forward and backward).
        microbatches_per_step: Microbatches per optimizer step and data-parallel rank.
        peft: Full fine-tuning or LoRA adapters on a frozen base.
        optimizer: The optimizer's state per trained element.
        frozen_bits: Bits per element of the LoRA-adapted base weights, overriding what
            ``peft.base`` says (``base_bits``); None: from ``peft.base``. Embeddings, norms and
            the head stay as they are.
    """

    model: ModelMemoryShape
    mesh: MeshParameters = field(default_factory=MeshParameters)
    sequence_length: int
    microbatch_size: int = 1
    microbatches_per_step: int = 1
    peft: PeftConfig = field(default_factory=FullFineTuningConfig)
    optimizer: OptimizerMemory
    frozen_bits: float | None = None

    @property
    def base_bits(self) -> float | None:
        """Bits per LoRA-adapted base weight: ``frozen_bits``, else those of the configured base.

        An NF4 base (``peft.base: {kind: nf4}``) stores 4 bits per weight and its block scales:
        with ``double_quant`` an 8-bit absmax per block and a float32 per 256 of those, else a
        float32 absmax per block (4.13 and 4.5 bits at blocks of 64). None: stored like the rest.
        """
        lora = self.lora
        if self.frozen_bits is not None or lora is None:
            return self.frozen_bits
        match lora.base:
            case NF4BaseConfig(block_size=block, double_quant=True):
                return 4 + 8 / block + 32 / (256 * block)
            case NF4BaseConfig(block_size=block):
                return 4 + 32 / block
            case PlainBaseConfig():
                return None

    @property
    def lora(self) -> LoRAConfig | None:
        """The LoRA settings, or None under full fine-tuning."""
        match self.peft:
            case LoRAConfig():
                return self.peft
            case FullFineTuningConfig():
                return None
