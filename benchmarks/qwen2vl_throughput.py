"""Images in, text out: troupe's LLM.generate on a scaled-down random Qwen2-VL (ViT with 2D
rotary and the patch merger, Qwen2 decoder with M-RoPE) against Hugging Face's batched
generate on the same weights, in one invocation; and the input processor's time per image
(decode, Qwen2-VL's PIL image processor, placeholder expansion).

Workload (defaults): 64 requests, each one distinct random 448x448 image (32 x 32 patches
of 14 px, merged 2 x 2: 256 image tokens) and the same short question, 64 greedy output
tokens (ignore_eos). Equal prompt lengths let Hugging Face batch without padding.

    python benchmarks/qwen2vl_throughput.py
    python benchmarks/qwen2vl_throughput.py --num-requests 16 --max-tokens 32 --hf-batch-size 16

Timings on a shared machine swing with its load: compare figures from one invocation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

if __name__ == "__main__":  # this checkout first, and benchmarks/kernels.py must not shadow kernels/
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [os.path.dirname(_here)] + [path for path in sys.path
                                           if os.path.abspath(path or os.curdir) != _here]

import torch

from benchmarks.llava_throughput import draw_images, run_troupe  # noqa: E402

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def build_model(out_dir: str) -> str:
    """A random Qwen2-VL: ViT 4 x 256 wide, patch 14, merge 2; Qwen2 4 x 512 wide (head 64,
    mrope_section 8/12/12); the tiny test tokenizer with Qwen2-VL's vision tokens."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokens = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    start, pad, end = tokenizer.convert_tokens_to_ids(tokens)
    text = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=2048, vocab_size=len(tokenizer), bos_token_id=0,
                eos_token_id=0, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]})
    vision = dict(depth=4, embed_dim=256, hidden_size=512, num_heads=4, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, vision_start_token_id=start, image_token_id=pad,
                           vision_end_token_id=end, video_token_id=pad, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil().save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=448, help="pixels per side of each image")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="0: skip Hugging Face")
    args = parser.parse_args()

    from actors import LLM, SamplingParams

    model_dir = build_model(tempfile.mkdtemp(prefix="qwen2vl-bench-"))
    images = draw_images(args.num_requests, args.image_size)
    llm = LLM(model_dir, kv_cache_memory="1GiB")
    question = llm.get_tokenizer().encode(f"<|im_start|>user\n{IMAGE}What is in the picture?<|im_end|>\n"
                                          "<|im_start|>assistant\n")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs, troupe_s, num_tokens = run_troupe(llm, question, images, params)
    # the ViT's share: both engines run the same fp32 vision work per image
    vision = llm.engine.runner.vision
    probes = [llm.inputs.process_media(question, params, multi_modal_data={"image": image})[2][0]
              for image in images[:4]]
    from actors.models.qwen2_vl import image_patches

    start = time.perf_counter()
    vision.encoder.encode_many([image_patches(mm) for mm in probes])  # (as a step starting 4 images does)
    vit_s = (time.perf_counter() - start) / len(probes)
    print(f"troupe's ViT: {vit_s * 1e3:.0f} ms per image, {vit_s * len(images) / troupe_s:.0%} of its time")
    if not args.hf_batch_size:
        return

    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    expanded = outputs[0].prompt_token_ids  # the placeholder already expanded, as Qwen2VLProcessor would
    start = time.perf_counter()
    hf_tokens = 0
    with torch.inference_mode():
        for first in range(0, len(images), args.hf_batch_size):
            batch = images[first: first + args.hf_batch_size]
            processed = processor(images=batch, return_tensors="pt")
            input_ids = torch.tensor([expanded] * len(batch))
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                                 pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
                                 do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=0)
            hf_tokens += (out.shape[1] - len(expanded)) * len(batch)
    hf_s = time.perf_counter() - start
    print(f"Hugging Face generate (batch {args.hf_batch_size}): {hf_tokens / hf_s:.1f} output tok/s ({hf_s:.1f} s)")
    print(f"ratio: {(num_tokens / troupe_s) / (hf_tokens / hf_s):.2f}x")
    with torch.inference_mode():
        processed = processor(images=images[:4], return_tensors="pt")
        start = time.perf_counter()
        model.model.visual(processed["pixel_values"], grid_thw=processed["image_grid_thw"])
        hf_vit_s = (time.perf_counter() - start) / 4
    rest_troupe, rest_hf = troupe_s - vit_s * len(images), hf_s - hf_vit_s * len(images)
    print(f"Hugging Face's ViT: {hf_vit_s * 1e3:.0f} ms per image; without the ViTs: troupe {rest_troupe:.1f} s, "
          f"Hugging Face {rest_hf:.1f} s, ratio {rest_hf / rest_troupe:.2f}x")


if __name__ == "__main__":
    main()
