"""Images in, text out: LLaVA-style vision-language models (docs/multimodal.md).

config.py (torch-free): what a vision model's config.json says and the engine flags that
go with it; inputs.py: decoding images and expanding their placeholders (the input
processor's side); llava.py: the CLIP vision tower and projector (the worker's side);
runner.py: the worker's per-request encoder cache and the merge into the embeddings."""
