"""Images in, text out: troupe's LLM.generate on a scaled-down random LLaVA (CLIP vision
tower, MLP projector, Llama decoder) against Hugging Face's batched generate on the same
weights, in one invocation; and the input processor's time per image (decode, the PIL image
processor, placeholder expansion).

Workload (defaults): 64 requests, each one distinct random image (224x224 drawn, resized by
the processor to the tower's 224 px: 256 image tokens) and the same short question, 64
greedy output tokens (ignore_eos). Equal prompt lengths let Hugging Face batch without padding.

    python benchmarks/llava_throughput.py
    python benchmarks/llava_throughput.py --num-requests 16 --max-tokens 32 --hf-batch-size 16

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

import numpy as np
import torch


def build_model(out_dir: str, image_size: int) -> str:
    """A random LLaVA: CLIP 4 x 256 wide, patch 14; Llama 4 x 512 wide; the tiny test tokenizer."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from tests.conftest import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                              image_size=image_size, patch_size=14)
    text = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, max_position_embeddings=2048, vocab_size=len(tokenizer),
                       bos_token_id=0, eos_token_id=0)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    CLIPImageProcessorPil(size={"shortest_edge": image_size},
                          crop_size={"height": image_size, "width": image_size}).save_pretrained(out_dir)
    return out_dir


def draw_images(count: int, size: int, seed: int = 0) -> list:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8), "RGB") for _ in range(count)]


def run_troupe(llm, question: list[int], images: list, params) -> tuple[list, float, int]:
    """The input processor's time per image, then troupe's timed generate of one request per
    image (after a warm-up, prefix cache emptied): (outputs, seconds, output tokens)."""
    requests = [{"prompt_token_ids": question, "multi_modal_data": {"image": image}} for image in images]
    start = time.perf_counter()
    for image in images:
        llm.inputs.process_media(question, params, multi_modal_data={"image": image})
    per_image_ms = (time.perf_counter() - start) / len(images) * 1e3
    print(f"input processor: {per_image_ms:.2f} ms per image (decode, image processor, placeholder expansion)")

    llm.generate(requests[:2], params, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    troupe_s = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"troupe: {num_tokens / troupe_s:.1f} output tok/s ({len(images)} requests, "
          f"{len(outputs[0].prompt_token_ids)} prompt tokens each, {troupe_s:.1f} s)")
    return outputs, troupe_s, num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224, help="the tower's pixels per side")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="0: skip Hugging Face")
    args = parser.parse_args()

    from actors import LLM, SamplingParams

    model_dir = build_model(tempfile.mkdtemp(prefix="llava-bench-"), args.image_size)
    images = draw_images(args.num_requests, args.image_size)
    llm = LLM(model_dir, kv_cache_memory="1GiB")
    question = llm.get_tokenizer().encode("USER: <image>\nWhat is in the picture? ASSISTANT:")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs, troupe_s, num_tokens = run_troupe(llm, question, images, params)
    if not args.hf_batch_size:
        return

    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    processor = AutoImageProcessor.from_pretrained(model_dir)
    expanded = outputs[0].prompt_token_ids  # the placeholder already expanded, as LlavaProcessor would
    start = time.perf_counter()
    hf_tokens = 0
    with torch.inference_mode():
        for first in range(0, len(images), args.hf_batch_size):
            batch = images[first: first + args.hf_batch_size]
            pixels = torch.from_numpy(processor(images=batch, return_tensors="np")["pixel_values"])
            out = model.generate(input_ids=torch.tensor([expanded] * len(batch)), pixel_values=pixels,
                                 do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=0)
            hf_tokens += (out.shape[1] - len(expanded)) * len(batch)
    hf_s = time.perf_counter() - start
    print(f"Hugging Face generate (batch {args.hf_batch_size}): {hf_tokens / hf_s:.1f} output tok/s ({hf_s:.1f} s)")
    print(f"ratio: {(num_tokens / troupe_s) / (hf_tokens / hf_s):.2f}x")


if __name__ == "__main__":
    main()
