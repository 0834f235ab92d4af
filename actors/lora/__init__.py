"""Multi-LoRA serving: adapters checked against the model (adapter_files, torch-free),
loaded and placed in each worker's slots (weights, slots), and the per-step batch the
model adds their deltas with (batch)."""
