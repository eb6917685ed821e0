"""GPT-OSS: the family's config.json, decoder layer and name table.

The models, loading, parallelism and the provider are the decoder core's, shared by every
family: ``d9d.hf.DecoderCausalLM``, ``d9d.hf.HFModelProvider``, ``d9d.hf.parallelize_decoder``, ...
"""

from d9d.hf.gpt_oss._config import GptOssConfig, read_gpt_oss_config
from d9d.hf.gpt_oss._decoder_layer import GptOssDecoderLayer, GptOssLayerSpec

__all__ = ["GptOssConfig", "GptOssDecoderLayer", "GptOssLayerSpec", "read_gpt_oss_config"]
