"""DeepSeek-V3: the family's config.json, decoder layer and name table.

The models, loading, parallelism and the provider are the decoder core's, shared by every
family: ``d9d.hf.DecoderCausalLM``, ``d9d.hf.HFModelProvider``, ``d9d.hf.parallelize_decoder``, ...
"""

from d9d.hf.deepseek_v3._config import DeepseekV3Config, read_deepseek_v3_config
from d9d.hf.deepseek_v3._decoder_layer import DeepseekV3DecoderLayer
from d9d.hf.deepseek_v3._spec import DeepseekV3LatentSpec, DeepseekV3MoeSpec, DeepseekV3Spec

__all__ = [
    "DeepseekV3Config",
    "DeepseekV3DecoderLayer",
    "DeepseekV3LatentSpec",
    "DeepseekV3MoeSpec",
    "DeepseekV3Spec",
    "read_deepseek_v3_config",
]
