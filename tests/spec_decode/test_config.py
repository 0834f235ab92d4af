"""SpeculativeConfig parsing: vLLM's JSON form, its defaults, and errors naming the field."""

import pytest

from actors.config.speculative import SpeculativeConfig, parse_speculative_config


def test_no_config_means_no_speculation():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("") is None


def test_ngram_from_json_with_vllm_default_bounds():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                       prompt_lookup_min=5, prompt_lookup_max=5)


@pytest.mark.parametrize("given, expected", [
    ({"prompt_lookup_max": 4}, (4, 4)),  # the missing bound copies the given one
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 6}, (2, 6)),
])
def test_ngram_bounds_fill_each_other(given, expected):
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected


def test_suffix_defaults_k_to_the_tree_depth_and_keeps_its_options():
    config = parse_speculative_config({"method": "suffix", "suffix_decoding_max_tree_depth": 16,
                                       "suffix_decoding_min_token_prob": 0.25})
    assert config.num_speculative_tokens == 16
    assert config.suffix_decoding_max_tree_depth == 16
    assert config.suffix_decoding_min_token_prob == 0.25
    assert config.suffix_decoding_max_cached_requests == 10000
    assert config.suffix_decoding_max_spec_factor == 1.0
    assert config.prompt_lookup_min is None


def test_draft_model_keeps_its_path_and_a_bare_model_implies_it():
    explicit = parse_speculative_config({"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4,
                                         "disable_by_batch_size": 8})
    assert explicit.model == "/m/draft" and explicit.disable_by_batch_size == 8
    assert parse_speculative_config({"model": "/m/draft", "num_speculative_tokens": 4}).method == "draft_model"
    assert parse_speculative_config({"model": "ngram", "num_speculative_tokens": 4}).method == "ngram"


@pytest.mark.parametrize("value, field", [
    ({"method": "eagle3", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": -1}, "suffix_decoding_max_spec_factor"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
])
def test_bad_configs_raise_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        parse_speculative_config(value)


def test_bad_json_and_non_objects_raise():
    with pytest.raises(ValueError, match="JSON"):
        parse_speculative_config('{"method": ')
    with pytest.raises(ValueError, match="object"):
        parse_speculative_config("[1, 2]")
