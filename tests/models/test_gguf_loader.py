"""GGUF files: tiny models converted to Hugging Face directories equal the originals (weights,
rope, tokenizer), conversion caching and races, and the embedded SmolLM2 against transformers' own
GGUF loading."""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from actors.models import gguf_convert, loader
from actors.models.loader import iter_weights, load_model_config, load_tokenizer, resolve_model
from tests.models.test_loader import PROMPTS, read_json, read_safetensors


# --- GGUF conversion of tiny models ---------------------------------------------------------

def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows of llama models."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def llama3_rope_divisors(model_dir: str) -> np.ndarray:
    """rope_freqs as llama.cpp writes it: default inverse frequencies over transformers' scaled ones."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(model_dir)
    scaled_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim, theta = config.head_dim, config.rope_parameters["rope_theta"]
    default_inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (default_inv_freq / scaled_inv_freq).numpy().astype(np.float32)


def write_gguf(model_dir: str, gguf_path: str, family: Callable | None = None, write_experts=None) -> None:
    """Export a tiny Hugging Face model the way llama.cpp would (F32 tensors, so exactly).
    family(writer, config) -> (name, values) -> values: a family's metadata written, and what
    llama.cpp does to its tensors (tests/models/test_gguf_families.py). write_experts(writer,
    config, weights) -> the HF names it wrote: an MoE model's experts (tests/models/moe_models.py)."""
    import gguf

    config = read_json(os.path.join(model_dir, "config.json"))
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
            "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3,
            "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
            "gpt_oss": gguf.MODEL_ARCH.GPT_OSS}[config["model_type"]]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    tensor_names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(gguf_path, arch_name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # (Gemma 3's global layers')
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    tokenizer_json = read_json(os.path.join(model_dir, "tokenizer.json"))
    vocab = tokenizer_json["model"]["vocab"]
    special_ids = {token["id"] for token in tokenizer_json["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(sorted(vocab, key=vocab.get))
    writer.add_token_types([3 if token_id in special_ids else 1 for token_id in range(len(vocab))])
    writer.add_token_merges([" ".join(merge) for merge in tokenizer_json["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(load_tokenizer(model_dir).chat_template)

    transform = family(writer, config) if family is not None else None
    if config["rope_parameters"].get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(model_dir))
    weights = read_safetensors(model_dir)
    written = write_experts(writer, config, weights) if write_experts is not None else set()
    for hf_name, tensor in weights.items():
        if hf_name in written:
            continue
        base_name, suffix = hf_name.rsplit(".", 1)
        values = tensor.numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and base_name.endswith("q_proj"):
            values = llama_cpp_permute(values, config["num_attention_heads"])
        elif arch == gguf.MODEL_ARCH.LLAMA and base_name.endswith("k_proj"):
            values = llama_cpp_permute(values, config["num_key_value_heads"])
        values = transform(hf_name, values) if transform is not None else values
        writer.add_tensor(f"{tensor_names.get_name(base_name)}.{suffix}", np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> str:
    cache_root = str(tmp_path / "cache")
    monkeypatch.setenv("TROUPE_CACHE", cache_root)
    return cache_root


@pytest.fixture(scope="module")
def tiny_llama31_dir(make_tiny_model) -> str:
    """Llama 3.1's rope scaling, the only one llama.cpp's rope_freqs tensor is read back as."""
    rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
    return make_tiny_model("llama", rope_theta=500000.0, rope_scaling=rope_scaling, tie_word_embeddings=True,
                           max_position_embeddings=131072)


@pytest.mark.parametrize("fixture_name", ["tiny_llama_dir", "tiny_llama31_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_gguf_conversion_restores_the_hugging_face_model(request, tmp_path, private_cache, fixture_name):
    model_dir = request.getfixturevalue(fixture_name)
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf(model_dir, gguf_path)

    converted_dir = resolve_model(gguf_path)
    assert os.path.dirname(converted_dir) == private_cache

    # Same tensors bit for bit: names mapped back, q/k rows of llama un-permuted.
    expected, converted = read_safetensors(model_dir), dict(iter_weights(converted_dir))
    assert converted.keys() == expected.keys()
    assert all(torch.equal(converted[name], expected[name]) for name in expected)
    # Same config, except that a GGUF keeps a single eos id.
    original_config, converted_config = load_model_config(model_dir), load_model_config(converted_dir)
    assert converted_config.eos_token_ids == (2,)
    for field in original_config.__dataclass_fields__.keys() - {"model_path", "eos_token_ids"}:
        assert getattr(converted_config, field) == getattr(original_config, field), field
    # Same tokenizer.
    original_tokenizer, converted_tokenizer = load_tokenizer(model_dir), load_tokenizer(converted_dir)
    for text in PROMPTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert converted_tokenizer(text)["input_ids"] == original_tokenizer(text)["input_ids"]
    assert converted_tokenizer.chat_template == original_tokenizer.chat_template


def test_gguf_with_unrecognized_rope_freqs_is_rejected(tiny_llama3_dir, tmp_path, private_cache):
    # tiny_llama3_dir's original context (128) is not Llama 3.x's 8192: say so, do not guess.
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf(tiny_llama3_dir, gguf_path)
    with pytest.raises(ValueError, match="rope_freqs"):
        resolve_model(gguf_path)


def test_gguf_is_converted_once_and_again_when_the_file_changes(tiny_llama_dir, tmp_path, private_cache, monkeypatch):
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf(tiny_llama_dir, gguf_path)
    converted_dir = resolve_model(gguf_path)
    weights_mtime = os.stat(os.path.join(converted_dir, "model.safetensors")).st_mtime_ns

    # A second resolve must not convert at all.
    def convert_gguf_must_not_run(*args):
        raise AssertionError("converted again")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_convert, "convert_gguf", convert_gguf_must_not_run)
        assert resolve_model(gguf_path) == converted_dir
    assert os.stat(os.path.join(converted_dir, "model.safetensors")).st_mtime_ns == weights_mtime

    # An edited file (new mtime) gets a directory of its own; no staging directory is left.
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))
    reconverted_dir = resolve_model(gguf_path)
    assert reconverted_dir != converted_dir
    assert sorted(os.listdir(private_cache)) == sorted(map(os.path.basename, [converted_dir, reconverted_dir]))


def test_failed_gguf_conversion_leaves_nothing_in_the_cache(tiny_llama_dir, tmp_path, private_cache, monkeypatch):
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf(tiny_llama_dir, gguf_path)

    def tokenizer_fails(*args):
        raise RuntimeError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_convert, "_write_tokenizer", tokenizer_fails)
        with pytest.raises(RuntimeError, match="disk full"):
            resolve_model(gguf_path)
    assert os.listdir(private_cache) == []
    assert os.path.isfile(os.path.join(resolve_model(gguf_path), "tokenizer.json"))


def test_conversion_that_loses_a_race_returns_the_winners_directory(tiny_llama_dir, tmp_path, private_cache,
                                                                   monkeypatch):
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf(tiny_llama_dir, gguf_path)
    real_convert_gguf = gguf_convert.convert_gguf

    def convert_while_another_process_publishes(path: str, staging_dir: str) -> None:
        real_convert_gguf(path, staging_dir)
        # Staging is ".<target name>.<random>": publish a finished copy at the target first.
        target_dir = os.path.join(private_cache, os.path.basename(staging_dir)[1:].rsplit(".", 1)[0])
        shutil.copytree(staging_dir, target_dir)
        open(os.path.join(target_dir, "winner"), "w").close()

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert_while_another_process_publishes)
    converted_dir = resolve_model(gguf_path)
    assert os.listdir(private_cache) == [os.path.basename(converted_dir)]
    assert os.path.isfile(os.path.join(converted_dir, "winner"))
    assert load_model_config(converted_dir).architecture == "LlamaForCausalLM"


def test_large_gguf_is_written_in_shards(tiny_qwen3_dir, tmp_path, private_cache, monkeypatch):
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 64 * 1024)
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf(tiny_qwen3_dir, gguf_path)
    converted_dir = resolve_model(gguf_path)
    weight_map = read_json(os.path.join(converted_dir, "model.safetensors.index.json"))["weight_map"]
    assert len(set(weight_map.values())) > 1
    expected, converted = read_safetensors(tiny_qwen3_dir), dict(iter_weights(converted_dir))
    assert converted.keys() == expected.keys() == weight_map.keys()
    assert all(torch.equal(converted[name], expected[name]) for name in expected)


def test_unknown_gguf_tensor_name_is_rejected():
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        gguf_convert.hf_tensor_name("blk.0.attn_qkv.weight")
    assert gguf_convert.hf_tensor_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"


# --- the embedded SmolLM2 -------------------------------------------------------------------

def load_with_transformers_gguf(gguf_path: str, monkeypatch):
    from transformers import AutoModelForCausalLM
    import transformers.modeling_utils

    if importlib.util.find_spec("accelerate") is None:
        # transformers demands accelerate before any GGUF load, though its CPU path never uses it.
        monkeypatch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)


def test_smollm2_conversion_matches_transformers_gguf_loading(smollm2_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    reference = load_with_transformers_gguf(loader.default_model_path(), monkeypatch)
    input_ids = load_tokenizer(smollm2_dir)("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        converted_logits, reference_logits = converted(input_ids).logits, reference(input_ids).logits
    torch.testing.assert_close(converted_logits, reference_logits, atol=1e-4, rtol=1e-4)


def test_smollm2_config_and_tokenizer(smollm2_dir):
    config = load_model_config(smollm2_dir)
    assert (config.architecture, config.hidden_size, config.num_hidden_layers) == ("LlamaForCausalLM", 576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.rope_theta, config.tie_word_embeddings, config.vocab_size) == (100000.0, True, 49152)
    assert (config.eos_token_ids, config.bos_token_id) == ((2,), 1)

    tokenizer = load_tokenizer(smollm2_dir)
    text = "Hello world 😀 你好"
    # Ids from transformers' own tokenizer of the GGUF file; no BOS is added.
    assert tokenizer(text)["input_ids"] == [19556, 905, 40303, 218, 216, 18645, 250, 48392, 138]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_second_resolve_reuses_the_cache(smollm2_dir, monkeypatch):
    weights_mtime = os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda *args: pytest.fail("converted again"))
    started = time.perf_counter()
    assert resolve_model(None) == resolve_model("default") == smollm2_dir
    assert time.perf_counter() - started < 1.0
    assert os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns == weights_mtime
