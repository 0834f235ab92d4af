"""A vision-language model's config.json, read without torch: the vision tower's shape, the
image token, and which hidden states feed the projector. Also the engine's checks of the
features that do not combine with a vision model yet, and --limit-mm-per-prompt."""

from __future__ import annotations

import json
from dataclasses import dataclass

from actors.config.qwen2_vl import QWEN2_5_VL, QWEN2_VL, Qwen2VLVisionConfig, split_qwen2_vl_config
from actors.config.vision_towers import tower_defaults

VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                        "Qwen2_5_VLForConditionalGeneration")
# the text models a LLaVA checkpoint may wrap, by text_config.model_type
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DEFAULT_LIMIT_PER_PROMPT = 1  # vLLM's default for every modality: more only when --limit-mm-per-prompt says so
MODALITIES = ("image",)


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA model's vision side (CLIP or SigLIP vision tower, MLP projector)."""

    architecture: str  # e.g. "LlavaForConditionalGeneration"
    image_token_id: int  # the placeholder token that image features replace
    hidden_size: int  # the vision tower's
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int  # pixels along each side the tower was trained on
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str  # the tower's MLP activation ("quick_gelu", "gelu")
    projector_hidden_act: str  # between the projector's two linears
    projector_bias: bool
    feature_layers: tuple[int, ...]  # hidden states fed to the projector (concatenated), e.g. (-2,)
    feature_select_strategy: str  # "default": drop the CLS position; "full": keep it
    tower: str = "clip_vision_model"  # vision_config.model_type: CLIP or SigLIP (towers.py)
    # a Qwen2-VL's own vision side (the fields above then hold its ViT's nearest equivalents)
    qwen2_vl: Qwen2VLVisionConfig | None = None


def split_vision_config(config: dict, config_path: str) -> tuple[dict, VisionConfig]:
    """(the text model's config as a ...ForCausalLM config.json would hold it, the vision
    side) of a LLaVA config.json; ValueError for what the engine cannot run."""
    if config["architectures"][0] in (QWEN2_VL, QWEN2_5_VL):  # (its layout: qwen2_vl_config.py)
        text, qwen2_vl = split_qwen2_vl_config(config, config_path)
        return text, VisionConfig(
            architecture=qwen2_vl.architecture, image_token_id=qwen2_vl.image_token_id,
            hidden_size=qwen2_vl.embed_dim, intermediate_size=int(qwen2_vl.embed_dim * qwen2_vl.mlp_ratio),
            num_hidden_layers=qwen2_vl.depth, num_attention_heads=qwen2_vl.num_heads, image_size=0,  # (any)
            patch_size=qwen2_vl.patch_size, num_channels=qwen2_vl.in_channels, layer_norm_eps=1e-6,
            hidden_act=qwen2_vl.hidden_act, projector_hidden_act="gelu", projector_bias=True, feature_layers=(-1,),
            feature_select_strategy="full", qwen2_vl=qwen2_vl)
    text = dict(config.get("text_config") or {})
    model_type = text.get("model_type", "llama")
    if model_type not in _TEXT_ARCHITECTURES:
        raise ValueError(f"{config_path}: a LLaVA model over a {model_type!r} text model is not supported "
                         f"(supported: {', '.join(_TEXT_ARCHITECTURES)})")
    text["architectures"] = [_TEXT_ARCHITECTURES[model_type]]
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if text.get(key) is None and config.get(key) is not None:
            text[key] = config[key]
    tower, vision = tower_defaults(config.get("vision_config") or {}, config_path)  # CLIP or SigLIP
    image_token_id = config.get("image_token_index", config.get("image_token_id"))
    if image_token_id is None:
        raise ValueError(f"{config_path}: missing 'image_token_index'")
    layers = config.get("vision_feature_layer", -2)
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"{config_path}: vision_feature_select_strategy {strategy!r} is not supported")
    return text, VisionConfig(
        architecture=config["architectures"][0], image_token_id=int(image_token_id),
        hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
        num_hidden_layers=vision["num_hidden_layers"], num_attention_heads=vision["num_attention_heads"],
        image_size=vision["image_size"], patch_size=vision["patch_size"], num_channels=vision.get("num_channels", 3),
        layer_norm_eps=float(vision["layer_norm_eps"]), hidden_act=vision["hidden_act"],
        projector_hidden_act=config.get("projector_hidden_act", "gelu"),
        projector_bias=bool(config.get("multimodal_projector_bias", True)),
        feature_layers=tuple(layers) if isinstance(layers, list) else (int(layers),),
        feature_select_strategy=strategy, tower=tower)


def parse_limit_mm_per_prompt(value: str | dict | None) -> dict[str, int]:
    """--limit-mm-per-prompt in vLLM's JSON form ('{"image": 4}'): the most items of each
    modality one prompt may carry (default 1 each). ValueError naming the flag."""
    limits = dict.fromkeys(MODALITIES, DEFAULT_LIMIT_PER_PROMPT)
    if value is None:
        return limits
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"limit_mm_per_prompt must be a JSON object such as '{{\"image\": 4}}': {error}") \
                from None
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must be a JSON object such as '{{\"image\": 4}}', got {value!r}")
    for modality, limit in value.items():
        if modality not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: modality {modality!r} is not supported (supported: "
                             f"{', '.join(MODALITIES)})")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt: {modality!r} must be a non-negative integer, got {limit!r}")
        limits[modality] = limit
    return limits


def check_vision_engine(vision: VisionConfig | None, *, tensor_parallel_size: int, speculative: bool,
                        enable_lora: bool, pooling: bool, pipeline_parallel_size: int = 1,
                        data_parallel_size: int = 1) -> None:
    """The features not built for vision models yet, refused by name at start-up."""
    if vision is None:
        return
    refused = [name for name, on in (("tensor_parallel_size > 1", tensor_parallel_size != 1),
                                     ("pipeline_parallel_size > 1", pipeline_parallel_size != 1),
                                     ("data_parallel_size > 1", data_parallel_size != 1),
                                     ("speculative decoding (speculative_config)", speculative),
                                     ("LoRA (enable_lora)", enable_lora),
                                     ("pooling (runner/convert)", pooling)) if on]
    if refused:
        raise ValueError(f"{vision.architecture} does not run with {', '.join(refused)} yet (docs/multimodal.md)")
