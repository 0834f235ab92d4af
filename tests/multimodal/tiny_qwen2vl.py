"""A tiny random Qwen2-VL (ViT with 2D rotary and the patch merger, Qwen2 decoder with
M-RoPE) saved as a Hugging Face directory with its processor pieces built offline (the tiny
tokenizer plus Qwen2-VL's vision tokens, the PIL-based Qwen2VLImageProcessorPil), and Hugging
Face's greedy output on it."""

from __future__ import annotations

import torch

from tests.conftest import _randomize_weights, build_tiny_tokenizer

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE = VISION_START + IMAGE_PAD + VISION_END  # what a prompt writes for each image
# small images: 28-pixel units (patch 14 x merge 2), at most 8 x 8 merged tokens
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 64


def build_tiny_qwen2vl(out_dir: str, seed: int = 0, vision_depth: int = 2, text_layers: int = 2,
                       hidden_size: int = 64, embed_dim: int = 32, qwen2_5: bool = False) -> str:
    """qwen2_5: a Qwen2.5-VL (RMSNorm, gated MLP, windows of 2 x 2 merged patches in block 0,
    full attention in block 1)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END]})
    ids = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])
    head_dim = 16
    text = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=text_layers,
                num_attention_heads=hidden_size // head_dim, num_key_value_heads=2, max_position_embeddings=1024,
                vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=vision_depth, embed_dim=embed_dim, hidden_size=hidden_size, num_heads=4, mlp_ratio=2,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
    if qwen2_5:
        vision = dict(depth=vision_depth, hidden_size=embed_dim, intermediate_size=2 * embed_dim, num_heads=4,
                      out_hidden_size=hidden_size, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      hidden_act="silu", window_size=56, fullatt_block_indexes=[vision_depth - 1])
    prefix = "Qwen2_5_VL" if qwen2_5 else "Qwen2VL"
    config = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config=vision, vision_start_token_id=ids[0], image_token_id=ids[1],
        vision_end_token_id=ids[2], video_token_id=ids[1], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    _randomize_weights(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out_dir)
    return out_dir


def hf_qwen2vl(model_dir: str, prompts: list[tuple[list[int], list]], max_tokens: int, model=None
               ) -> list[tuple[list[int], list[float]]]:
    """Hugging Face's greedy (tokens, chosen-token logprobs) of each (token ids with one
    <|image_pad|> per image, images)."""
    import json

    import transformers
    from transformers import AutoImageProcessor

    if model is None:
        with open(f"{model_dir}/config.json") as config:
            architecture = json.load(config)["architectures"][0]
        model = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    image_token_id = model.config.image_token_id
    merge = model.config.vision_config.spatial_merge_size
    outputs = []
    with torch.inference_mode():
        for token_ids, images in prompts:
            kwargs, counts = {}, []
            if images:
                processed = image_processor(images=images, return_tensors="pt")
                kwargs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
                counts = [int(t * h * w) // merge**2 for t, h, w in processed["image_grid_thw"].tolist()]
            expanded, image = [], iter(counts)
            for token in token_ids:
                expanded += [token] * next(image) if token == image_token_id else [token]
            input_ids = torch.tensor([expanded])
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 mm_token_type_ids=(input_ids == image_token_id).int(), do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True, **kwargs)
            tokens = out.sequences[0, len(expanded):].tolist()
            logprobs = [torch.log_softmax(score[0].float(), -1)[token].item()
                        for score, token in zip(out.scores, tokens)]
            outputs.append((tokens, logprobs))
    return outputs
