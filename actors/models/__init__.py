"""The model families and how they are found and loaded: registry.py (architecture ->
module, class, imported on first use), the Llama-family decoder (llama.py, with the CPU's
one-call step: cpu_step.py), BERT-family encoders (bert.py, bert_config.py, encoder.py),
the vision towers and runners (llava.py, siglip.py, qwen2_vl.py, mrope.py,
vision_runner.py), and the loader (loader.py, gguf_convert.py: a path or a .gguf file ->
config, tokenizer, weights)."""
