"""The vision towers a LLaVA-style model may carry, read without torch: each tower's
config.json defaults (transformers' save_pretrained leaves defaults out, so a checkpoint's
vision_config names only what differs) and how many image features (placeholder tokens)
one image makes."""

from __future__ import annotations

from typing import Any

CLIP_TOWER = "clip_vision_model"
SIGLIP_TOWER = "siglip_vision_model"
# vision_config.model_type -> the defaults of the fields the engine reads. CLIP's are
# LlavaConfig's default tower (ViT-L/14 at 336 px); SigLIP's are SiglipVisionConfig's.
TOWER_DEFAULTS: dict[str, dict[str, Any]] = {
    CLIP_TOWER: {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                 "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "layer_norm_eps": 1e-5,
                 "hidden_act": "quick_gelu"},
    SIGLIP_TOWER: {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "layer_norm_eps": 1e-6,
                   "hidden_act": "gelu_pytorch_tanh"},
}


def tower_defaults(vision_config: dict, config_path: str) -> tuple[str, dict[str, Any]]:
    """(the tower's model_type, its config with the tower's defaults filled in); ValueError
    for a tower the engine does not run."""
    tower = vision_config.get("model_type", CLIP_TOWER)
    if tower not in TOWER_DEFAULTS:
        raise ValueError(f"{config_path}: vision tower {tower!r} is not supported (supported: "
                         f"{', '.join(TOWER_DEFAULTS)})")
    return tower, {**TOWER_DEFAULTS[tower], **{k: v for k, v in vision_config.items() if v is not None}}


def num_image_tokens(tower: str, patch_size: int, feature_select_strategy: str, height: int, width: int) -> int:
    """Image features of one processed image of height x width pixels: one per patch, plus
    CLIP's class position; the "default" strategy drops the first position (transformers'
    LLaVA does so whatever the tower, which is why SigLIP checkpoints ask for "full")."""
    patches = (height // patch_size) * (width // patch_size)
    positions = patches + (1 if tower == CLIP_TOWER else 0)
    return positions - (1 if feature_select_strategy == "default" else 0)


def check_processed_size(image_processor: Any, image_size: int, model_dir: str) -> None:
    """At start-up: the image processor must make images of the tower's size, whose position
    embeddings are fixed (a wrong pair would fail in the worker, mid-step). One 2:1 image
    through the processor: a processor that neither resizes to a square nor crops shows."""
    from PIL import Image

    pixels = image_processor(images=[Image.new("RGB", (2 * image_size, image_size))], return_tensors="np")
    height, width = pixels["pixel_values"].shape[-2:]
    if (height, width) != (image_size, image_size):
        raise ValueError(f"{model_dir}: the image processor makes {height}x{width} images, the vision tower takes "
                         f"{image_size}x{image_size} (preprocessor_config.json against vision_config.image_size)")
