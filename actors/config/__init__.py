"""Engine configuration, the floor every other part of actors/ stands on: frozen
dataclasses passed down explicitly (each component keeps only the fields it uses), one
module per domain, all torch-free (msgspec decodes EngineConfig in every actor process):

    engine.py      EngineConfig, the whole of it
    model.py       ModelConfig (the loader reads it from config.json: actors/models/loader.py)
    cache.py       CacheConfig, parse_size
    scheduler.py   SchedulerConfig
    parallel.py    ParallelConfig, the tensor-parallel size's check
    lora.py        LoRAConfig
    inputs.py      InputConfig: what a request's images and chat template may cost
    vision.py      VisionConfig, with vision_towers.py and qwen2_vl.py (a vision-language model's config.json)
    pooler.py      PoolerConfig (a pooling model's)
    speculative.py SpeculativeConfig (--speculative-config)
    quantization.py  a quantized checkpoint's quantization_config
    structured_output.py  what one request's grammar may cost
    env.py         the environment variables, read there and nowhere else

and the flags' machinery: cli_flags.py (how a field becomes a flag), json_flags.py, and
the torch-free flag groups EngineArgs (actors/engine/args.py) is built from: cuda_flags,
input_flags, kv_offload_flags, parallel_flags.

`from actors.config import EngineConfig, ModelConfig, ...` keeps working: the names are
re-exported here."""

from actors.config.cache import CacheConfig, parse_size
from actors.config.engine import EngineConfig
from actors.config.env import (DEFAULT_MAX_N_SEQUENCES, ENGINE_KEY_VARIABLE, cache_dir, engine_key, image_fetch_timeout,
                               max_n_sequences, media_redirects_allowed, runtime_lora_updating_allowed)
from actors.config.inputs import (DEFAULT_CHAT_TEMPLATE_TIMEOUT_S, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_TOTAL_IMAGE_PIXELS,
                                  InputConfig)
from actors.config.lora import LoRAConfig
from actors.config.model import ModelConfig
from actors.config.parallel import ParallelConfig, check_tensor_parallel_size
from actors.config.scheduler import SchedulerConfig

__all__ = ["CacheConfig", "parse_size", "EngineConfig", "DEFAULT_MAX_N_SEQUENCES", "ENGINE_KEY_VARIABLE", "cache_dir",
           "engine_key", "image_fetch_timeout", "max_n_sequences", "media_redirects_allowed",
           "runtime_lora_updating_allowed", "DEFAULT_CHAT_TEMPLATE_TIMEOUT_S", "DEFAULT_MAX_IMAGE_PIXELS",
           "DEFAULT_MAX_TOTAL_IMAGE_PIXELS", "InputConfig", "LoRAConfig", "ModelConfig", "ParallelConfig",
           "check_tensor_parallel_size", "SchedulerConfig"]
