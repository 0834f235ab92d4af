"""The decoder classification head and the Qwen3-Reranker yes/no head against Hugging Face
Qwen3 / Llama models (tiny, random, saved in the test). The decoder itself is tested
elsewhere: here the head is applied to Hugging Face's final-normed hidden states."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from actors.pooling.classifier import SCORE_WEIGHT, load_score_head, reranker_score_head, split_score_weight
from actors.config.pooler import read_pooler_config
from actors.pooling.pooler import Pooler, PoolingSpan, finish_logits
from actors.models.loader import iter_weights, load_model_config
from actors.models.llama import LlamaModel

TINY_DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
PROMPTS = [[5, 9, 3, 17, 40], [33], [8, 8, 61, 2, 12, 7, 30, 44]]


def make_config(family: str, **extra):
    from transformers import LlamaConfig, Qwen3Config

    return {"qwen3": Qwen3Config, "llama": LlamaConfig}[family](**TINY_DECODER, **extra)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_score_head_on_the_last_token_matches_hf(tmp_path, family: str) -> None:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    hf_model = AutoModelForSequenceClassification.from_config(make_config(family, num_labels=2)).eval()
    hf_model.save_pretrained(tmp_path)
    head = load_score_head(iter_weights(str(tmp_path)))
    assert head.num_labels == 2
    config = read_pooler_config(str(tmp_path), "classify")
    assert (config.pooling_type, config.activation) == ("LAST", "softmax")

    with torch.no_grad():
        expected = torch.cat([hf_model(torch.tensor([prompt])).logits for prompt in PROMPTS])
        # the final-normed hidden states of every prompt, back to back as a step's flat batch
        final_hidden = torch.cat([hf_model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
                                  for prompt in PROMPTS])
    spans, start = [], 0
    for index, prompt in enumerate(PROMPTS):
        spans.append(PoolingSpan(str(index), start, len(prompt), config.pooling_type, True, True))
        start += len(prompt)
    pooled = Pooler().pool(final_hidden, spans)
    logits = head(torch.stack([pooled[str(i)] for i in range(len(PROMPTS))]))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(finish_logits(logits, config.activation), torch.softmax(expected, -1))


def test_the_decoder_loads_a_classifier_checkpoint_less_its_score_weight(tmp_path) -> None:
    from transformers import Qwen3ForSequenceClassification

    torch.manual_seed(1)
    hf_model = Qwen3ForSequenceClassification(make_config("qwen3", num_labels=3))
    hf_model.save_pretrained(tmp_path / "classifier")
    # load_model_config knows only the ...ForCausalLM names: the same config under that name
    causal_dir = tmp_path / "as_causal"
    os.makedirs(causal_dir)
    with open(tmp_path / "classifier" / "config.json") as config_file:
        config = json.load(config_file)
    with open(causal_dir / "config.json", "w") as config_file:
        json.dump({**config, "architectures": ["Qwen3ForCausalLM"]}, config_file)
    shutil.copy(tmp_path / "classifier" / "model.safetensors", causal_dir)

    found: dict[str, torch.Tensor] = {}
    decoder = LlamaModel(load_model_config(str(causal_dir)), torch.float32, torch.device("cpu"), backend=None)
    decoder.load_weights(split_score_weight(iter_weights(str(tmp_path / "classifier")), found))
    torch.testing.assert_close(found[SCORE_WEIGHT], hf_model.score.weight.detach())
    torch.testing.assert_close(decoder.final_norm, hf_model.model.norm.weight.detach())
    torch.testing.assert_close(decoder.layers[1].o_proj, hf_model.model.layers[1].self_attn.o_proj.weight.detach())


def test_a_checkpoint_without_a_score_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="score.weight"):
        load_score_head([("model.norm.weight", torch.ones(4))])


def test_reranker_head_gives_the_yes_probability_over_yes_and_no(tmp_path) -> None:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(2)
    hf_model = Qwen3ForCausalLM(make_config("qwen3")).eval()
    yes_token_id, no_token_id = 20, 31
    head = reranker_score_head(hf_model.lm_head.weight.detach(), yes_token_id, no_token_id)
    assert head.num_labels == 1
    with torch.no_grad():
        for prompt in PROMPTS:
            output = hf_model(torch.tensor([prompt]), output_hidden_states=True)
            last_logits = output.logits[0, -1]
            expected = torch.softmax(last_logits[[yes_token_id, no_token_id]], -1)[0]
            score = finish_logits(head(output.hidden_states[-1][0, -1:]), "sigmoid")
            torch.testing.assert_close(score, expected.view(1, 1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        reranker_score_head(hf_model.lm_head.weight.detach(), 64, 0)
