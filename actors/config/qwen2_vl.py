"""A Qwen2-VL config.json, read without torch: the ViT's shape, the vision tokens and
M-RoPE's sections, and the Qwen2 decoder's config as a Qwen2ForCausalLM config.json would
hold it. Both layouts: the checkpoints' flat one (text keys at the top, `rope_scaling`
{"type": "mrope", ...}, vision `in_chans`) and transformers 5's (`text_config`,
`rope_parameters`, vision `in_channels`)."""

from __future__ import annotations

from dataclasses import dataclass

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"


@dataclass(frozen=True)
class Qwen2VLVisionConfig:
    """Qwen2-VL's vision side: the ViT (2D rotary, full attention within an image), the
    patch merger, and the decoder's M-RoPE sections."""

    architecture: str
    image_token_id: int  # <|image_pad|>: the placeholder that image features replace
    vision_start_token_id: int
    vision_end_token_id: int
    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    hidden_act: str  # the ViT's MLP activation ("quick_gelu")
    text_hidden_size: int  # the merger's output width: the decoder's hidden size
    mrope_section: tuple[int, int, int]  # rotary frequency pairs taken from the t, h, w positions
    # Qwen2.5-VL's ViT: RMSNorm, a gated MLP of intermediate_size, attention within windows of
    # window_size pixels except in the fullatt_block_indexes blocks
    qwen2_5: bool = False
    intermediate_size: int = 0
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()

    @property
    def patch_features(self) -> int:
        """Values of one flattened patch: channels x temporal_patch_size x patch_size^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Image features (placeholder tokens) of an image of this patch grid."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size ** 2


def split_qwen2_vl_config(config: dict, config_path: str) -> tuple[dict, Qwen2VLVisionConfig]:
    """(the Qwen2 decoder's config, the vision side) of a Qwen2-VL config.json; ValueError
    for what the engine cannot run."""
    text = {key: value for key, value in config.items() if key not in ("text_config", "vision_config")}
    text.update(config.get("text_config") or {})
    text["architectures"] = ["Qwen2ForCausalLM"]
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    text.pop("rope_scaling", None)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"{config_path}: Qwen2-VL with rope type {rope_type!r} is not supported")
    section = rope.get("mrope_section")
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if not section or len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"{config_path}: mrope_section must be three numbers summing to head_dim / 2 = "
                         f"{head_dim // 2}, got {section!r}")
    # the decoder's rotary is the default one over three position streams (actors/models/mrope.py)
    text["rope_parameters"] = {"rope_type": "default",
                               "rope_theta": float(rope.get("rope_theta", text.get("rope_theta", 1000000.0)))}
    vision = config.get("vision_config") or {}
    qwen2_5 = config["architectures"][0] == QWEN2_5_VL
    # (Qwen2.5-VL's vision hidden_size is the ViT's width, out_hidden_size the decoder's)
    embed_dim = vision.get("hidden_size", 1280) if qwen2_5 else vision.get("embed_dim", 1280)
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        if config.get(key) is None:
            raise ValueError(f"{config_path}: missing {key!r}")
    return text, Qwen2VLVisionConfig(
        architecture=config["architectures"][0], image_token_id=int(config["image_token_id"]),
        vision_start_token_id=int(config["vision_start_token_id"]),
        vision_end_token_id=int(config["vision_end_token_id"]), depth=int(vision.get("depth", 32)),
        embed_dim=int(embed_dim), num_heads=int(vision.get("num_heads", 16)),
        mlp_ratio=float(vision.get("mlp_ratio", 4)),
        in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
        patch_size=int(vision.get("patch_size", 14)), spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        hidden_act=vision.get("hidden_act", "quick_gelu"), text_hidden_size=int(text["hidden_size"]),
        mrope_section=tuple(int(s) for s in section), qwen2_5=qwen2_5,
        intermediate_size=int(vision.get("intermediate_size", 0)), window_size=int(vision.get("window_size", 0)),
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", ())))
