"""The model registry (actors/models/registry.py): architecture -> (module, class), imported
on first use; the loader's one place to learn what an architecture is."""

import json

import pytest

from actors.config.vision import VISION_ARCHITECTURES
from actors.models import registry
from actors.models.loader import SUPPORTED_ARCHITECTURES, load_model_config


def test_every_architecture_the_config_readers_know_is_registered():
    assert set(VISION_ARCHITECTURES) == set(registry.architectures("vision"))
    assert SUPPORTED_ARCHITECTURES == registry.architectures("decoder")
    assert {"BertModel", "RobertaForSequenceClassification", "XLMRobertaModel"} <= set(registry.architectures("encoder"))


def test_a_registered_class_is_imported_on_first_use():
    from actors.models.bert import BertModel
    from actors.models.llama import LlamaModel
    from actors.models.qwen2_vl import Qwen2VLRunner
    from actors.models.vision_runner import VisionRunner

    assert registry.model_class("Qwen3ForCausalLM") is LlamaModel
    assert registry.model_class("MistralForSequenceClassification") is LlamaModel
    assert registry.model_class("XLMRobertaModel") is BertModel
    assert registry.model_class("LlavaForConditionalGeneration") is VisionRunner
    assert registry.model_class("Qwen2_5_VLForConditionalGeneration") is Qwen2VLRunner


@pytest.mark.parametrize("architecture", ["GPT2LMHeadModel", None])
def test_an_unknown_architecture_fails_at_start_up_naming_the_supported_ones(tmp_path, architecture):
    config = {"architectures": [architecture] if architecture else [], "hidden_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        load_model_config(str(tmp_path))
    assert repr(architecture) in str(error.value)
    assert "LlamaForCausalLM" in str(error.value) and "BertModel" in str(error.value)
    assert "LlavaForConditionalGeneration" in str(error.value)
