"""A tiny random LLaVA (CLIP vision tower, MLP projector, Llama decoder) saved as a Hugging
Face directory with its processor (the tiny tokenizer plus an <image> token, a PIL-based
CLIP image processor), built offline; and images drawn with numpy."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

from tests.conftest import _randomize_weights, build_tiny_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 28  # pixels: 2 x 2 patches of 14, so 4 image features per image
NUM_IMAGE_TOKENS = 4


def build_tiny_llava(out_dir: str, seed: int = 0, image_size: int = IMAGE_SIZE) -> str:
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration)

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=image_size, patch_size=14, projection_dim=32)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=512, vocab_size=len(tokenizer),
                       bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    _randomize_weights(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    CLIPImageProcessorPil(size={"shortest_edge": image_size},
                          crop_size={"height": image_size, "width": image_size}).save_pretrained(out_dir)
    return out_dir


def draw_image(width: int, height: int, seed: int):
    """An RGB PIL image of random colour blocks, width x height pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    pixels = np.kron(blocks, np.ones((height // 4 + 1, width // 4 + 1, 1), dtype=np.uint8))[:height, :width]
    return Image.fromarray(np.ascontiguousarray(pixels), "RGB")


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def hf_greedy_llava(model_dir: str, prompts: list[tuple[list[int], list]], max_tokens: int) -> list[list[int]]:
    """Hugging Face's greedy output of each (token ids with one <image> token per image, images)."""
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    image_token_id = model.config.image_token_index
    outputs = []
    with torch.inference_mode():
        for token_ids, images in prompts:
            expanded = [t for token in token_ids
                        for t in ([token] * NUM_IMAGE_TOKENS if token == image_token_id else [token])]
            kwargs = {}
            if images:
                kwargs["pixel_values"] = torch.from_numpy(
                    image_processor(images=images, return_tensors="np")["pixel_values"])
            out = model.generate(input_ids=torch.tensor([expanded]), do_sample=False, max_new_tokens=max_tokens,
                                 pad_token_id=0, **kwargs)
            outputs.append(out[0, len(expanded):].tolist())
    return outputs
