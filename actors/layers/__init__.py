"""Layers shared by the worker, the models and the features: attention and its per-step
metadata, the tensor-parallel split and collectives, the quantized linear methods, and
sampling (the sampler, its persistent batch, the logits processors, random choice, the
custom processors' allow-list)."""
