"""read_pooler_config on directories sentence-transformers saved and on plain Hugging Face
ones, and the --pooler-config override."""

from __future__ import annotations

import json
import os

import pytest

from actors.config.pooler import parse_pooler_config_override, read_pooler_config
from tests.pooling.tiny_bert import save_bert, save_sentence_transformer


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_bert(str(tmp_path_factory.mktemp("bert")), seed=0)


def write_model_dir(model_dir, config: dict, modules: list[dict] | None = None,
                    pooling_config: dict | None = None) -> str:
    """A directory with only the JSON files read_pooler_config reads."""
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as config_file:
        json.dump(config, config_file)
    if modules is not None:
        with open(os.path.join(model_dir, "modules.json"), "w") as modules_file:
            json.dump(modules, modules_file)
    if pooling_config is not None:
        os.makedirs(os.path.join(model_dir, "1_Pooling"), exist_ok=True)
        with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as pooling_file:
            json.dump(pooling_config, pooling_file)
    return str(model_dir)


# modules.json as sentence-transformers before 6.x wrote it
LEGACY_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                  {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                  {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]


@pytest.mark.parametrize("pooling_mode,pooling_type", [("mean", "MEAN"), ("cls", "CLS"), ("lasttoken", "LAST")])
@pytest.mark.parametrize("normalize", [True, False])
def test_reads_what_sentence_transformers_saved(bert_dir: str, tmp_path, pooling_mode: str, pooling_type: str,
                                                normalize: bool) -> None:
    save_sentence_transformer(bert_dir, str(tmp_path), pooling_mode, normalize)
    config = read_pooler_config(str(tmp_path), "embed")
    assert (config.pooling_type, config.normalize, config.is_matryoshka) == (pooling_type, normalize, False)


def test_a_dense_module_is_refused(bert_dir: str, tmp_path) -> None:
    save_sentence_transformer(bert_dir, str(tmp_path), "mean", normalize=True, dense_features=16)
    with pytest.raises(ValueError, match="Dense"):
        read_pooler_config(str(tmp_path), "embed")


@pytest.mark.parametrize("legacy_key,pooling_type", [("pooling_mode_mean_tokens", "MEAN"),
                                                     ("pooling_mode_cls_token", "CLS"),
                                                     ("pooling_mode_lasttoken", "LAST")])
def test_reads_the_legacy_pooling_keys(tmp_path, legacy_key: str, pooling_type: str) -> None:
    pooling_config = {"word_embedding_dimension": 32, "pooling_mode_cls_token": False,
                      "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False, legacy_key: True}
    model_dir = write_model_dir(tmp_path, {"model_type": "qwen3"}, LEGACY_MODULES, pooling_config)
    config = read_pooler_config(model_dir, "embed")
    assert (config.pooling_type, config.normalize) == (pooling_type, True)


@pytest.mark.parametrize("pooling_config", [{"pooling_mode": "max"}, {"pooling_mode": ["mean", "cls"]},
                                            {"pooling_mode_max_tokens": True},
                                            {"pooling_mode": "mean", "include_prompt": False}])
def test_pooling_we_do_not_run_is_refused(tmp_path, pooling_config: dict) -> None:
    model_dir = write_model_dir(tmp_path, {"model_type": "bert"}, LEGACY_MODULES, pooling_config)
    with pytest.raises(ValueError, match="1_Pooling/config.json"):
        read_pooler_config(model_dir, "embed")


@pytest.mark.parametrize("model_type,pooling_type", [("bert", "CLS"), ("qwen3", "LAST"), ("llama", "LAST")])
def test_defaults_by_architecture_without_sentence_transformers_files(tmp_path, model_type: str,
                                                                      pooling_type: str) -> None:
    model_dir = write_model_dir(tmp_path, {"model_type": model_type, "num_labels": 3})
    embed = read_pooler_config(model_dir, "embed")
    assert (embed.pooling_type, embed.normalize, embed.activation, embed.num_labels) == (pooling_type, True, None, None)
    classify = read_pooler_config(model_dir, "classify")
    assert (classify.pooling_type, classify.normalize, classify.activation, classify.num_labels) == \
        (pooling_type, False, "softmax", 3)


@pytest.mark.parametrize("hf_config,activation,num_labels", [
    ({"num_labels": 1}, "sigmoid", 1),
    ({"id2label": {"0": "a", "1": "b"}}, "softmax", 2),
    ({"num_labels": 4, "problem_type": "multi_label_classification"}, "sigmoid", 4),
    ({"num_labels": 1, "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, None, 1),
    ({"num_labels": 2, "sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"},
     "sigmoid", 2),
])
def test_classification_activation(tmp_path, hf_config: dict, activation: str | None, num_labels: int) -> None:
    config = read_pooler_config(write_model_dir(tmp_path, {"model_type": "qwen2", **hf_config}), "classify")
    assert (config.activation, config.num_labels) == (activation, num_labels)


def test_an_unknown_model_type_has_no_default(tmp_path) -> None:
    with pytest.raises(ValueError, match="gpt2"):
        read_pooler_config(write_model_dir(tmp_path, {"model_type": "gpt2"}), "embed")
    # ... unless its sentence-transformers files say how it pools
    model_dir = write_model_dir(tmp_path, {"model_type": "gpt2"}, LEGACY_MODULES, {"pooling_mode": "mean"})
    assert read_pooler_config(model_dir, "embed").pooling_type == "MEAN"


def test_matryoshka_keys_of_config_json(tmp_path) -> None:
    listed = read_pooler_config(write_model_dir(tmp_path / "a", {"model_type": "qwen3",
                                                                "matryoshka_dimensions": [8, 16]}), "embed")
    assert (listed.is_matryoshka, listed.matryoshka_dimensions) == (True, (8, 16))
    flagged = read_pooler_config(write_model_dir(tmp_path / "b", {"model_type": "qwen3", "is_matryoshka": True}),
                                 "embed")
    assert (flagged.is_matryoshka, flagged.matryoshka_dimensions) == (True, None)


def test_override_merges_over_what_was_read(bert_dir: str, tmp_path) -> None:
    save_sentence_transformer(bert_dir, str(tmp_path), "cls", normalize=True)
    override = parse_pooler_config_override('{"pooling_type": "mean", "normalize": false, '
                                            '"matryoshka_dimensions": [16]}')
    config = read_pooler_config(str(tmp_path), "embed", override)
    assert (config.pooling_type, config.normalize) == ("MEAN", False)
    assert (config.is_matryoshka, config.matryoshka_dimensions) == (True, (16,))


@pytest.mark.parametrize("text,named", [
    ('{"pooling_typ": "MEAN"}', "pooling_typ"),
    ('{"pooling_type": "MAX"}', "pooling_type"),
    ('{"normalize": "yes"}', "normalize"),
    ('{"activation": "tanh"}', "activation"),
    ('{"matryoshka_dimensions": [0, 8]}', "matryoshka_dimensions"),
    ('["MEAN"]', "JSON object"),
    ('{"pooling_type": ', "not valid JSON"),
])
def test_bad_overrides_are_refused_by_name(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_pooler_config_override(text)


def test_all_pooling_is_refused_for_a_classifier(tmp_path) -> None:
    model_dir = write_model_dir(tmp_path, {"model_type": "qwen3", "num_labels": 2})
    with pytest.raises(ValueError, match="ALL"):
        read_pooler_config(model_dir, "classify", parse_pooler_config_override('{"pooling_type": "ALL"}'))
