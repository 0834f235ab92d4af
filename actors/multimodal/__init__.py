"""Images in, text out: LLaVA-style vision-language models (docs/multimodal.md).

Here, the input processor's side: inputs.py and qwen2_vl_inputs.py (decoding images and
expanding their placeholders), decode.py, fetch.py and local_media.py (reading images under
limits), prompt_images.py (images in prompt dicts). What a vision model's config.json says
is actors/config/vision.py; the vision towers and the worker's encoder cache are models
(actors/models/llava.py, siglip.py, qwen2_vl.py, vision_runner.py)."""
