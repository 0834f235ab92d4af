"""A tiny random LLaVA with a SigLIP vision tower (no class position, no pre-LayerNorm,
gelu_pytorch_tanh) and the PIL-based SiglipImageProcessor, built offline; and Hugging
Face's greedy tokens with each step's log-softmax, for any number of features per image."""

from __future__ import annotations

import torch

from tests.conftest import _randomize_weights, build_tiny_tokenizer
from tests.multimodal.tiny_llava import IMAGE_TOKEN

SIGLIP_IMAGE_SIZE = 42  # pixels: 3 x 3 patches of 14


def build_tiny_siglip_llava(out_dir: str, strategy: str = "full", feature_layer: int = -1, seed: int = 0) -> str:
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=SIGLIP_IMAGE_SIZE, patch_size=14, vision_use_head=True)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=512, vocab_size=len(tokenizer),
                       bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    _randomize_weights(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # saved as "SiglipImageProcessor", which AutoImageProcessor loads as the PIL one without torchvision
    SiglipImageProcessorPil(size={"height": SIGLIP_IMAGE_SIZE, "width": SIGLIP_IMAGE_SIZE}).save_pretrained(out_dir)
    return out_dir


def hf_greedy_with_logprobs(model_dir: str, prompts: list[tuple[list[int], list]], max_tokens: int,
                            num_image_tokens: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Hugging Face's greedy tokens and each step's log-softmax, for (token ids with one
    <image> token per image, images)."""
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    image_token_id = model.config.image_token_index
    tokens, logprobs = [], []
    with torch.inference_mode():
        for token_ids, images in prompts:
            expanded = [t for token in token_ids
                        for t in ([token] * num_image_tokens if token == image_token_id else [token])]
            kwargs = {}
            if images:
                kwargs["pixel_values"] = torch.from_numpy(
                    image_processor(images=images, return_tensors="np")["pixel_values"])
            out = model.generate(input_ids=torch.tensor([expanded]), do_sample=False, max_new_tokens=max_tokens,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
            tokens.append(out.sequences[0, len(expanded):].tolist())
            logprobs.append([step[0].float().log_softmax(-1) for step in out.logits])
    return tokens, logprobs
