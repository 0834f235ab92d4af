"""PEFT LoRA adapters built on the fly for the tests, and PEFT's greedy output as the oracle.

init_lora_weights=False gives B random values instead of PEFT's zeros: an adapter that
changes the output (PEFT's default one is the identity, and every comparison would pass)."""

from __future__ import annotations

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora_adapter(model_dir: str, out_dir: str, *, rank: int = 8, target_modules: list[str] | None = None,
                       alpha: float = 16, use_rslora: bool = False, seed: int = 0,
                       layers_to_transform: list[int] | None = None) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules or ALL_MODULES,
                        init_lora_weights=False, use_rslora=use_rslora, layers_to_transform=layers_to_transform)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # kaiming-uniform A and B make deltas far larger than the tiny weights: scale down
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(model_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt alone, greedy, through PeftModel with the adapter (the base model alone
    when adapter_dir is None), no EOS stop."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model = model.eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                                 pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
