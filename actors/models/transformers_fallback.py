"""The Transformers fallback (`--model-impl transformers`, vLLM's): any decoder-only causal LM
that Hugging Face transformers implements, run on transformers' own modeling code over
troupe's paged KV cache, with continuous batching, chunked prefill and prefix caching.

How it plugs in (as vLLM's model_executor/models/transformers.py):
- the model is `AutoModelForCausalLM.from_config(config)` (never remote code) with the
  checkpoint's weights, its attention implementation set to "troupe", a function
  registered once with `transformers.AttentionInterface`;
- a step's tokens, every scheduled token of every request, go in as one sequence of batch
  1 with their real positions (`position_ids`), so HF's own rotary embedding rotates each
  token at its place in its request; no mask is built (no mask function is registered
  under "troupe", so transformers skips it) and no HF cache is used;
- each attention module (found by its `layer_idx`) calls troupe_attention with its rotated
  q, k, v: the step's keys and values are stored into that layer's paged cache and the
  queries attend with the step's AttentionMetadata, through the engine's attention backend
  (torch reference, the CPU's C++ or Triton);
- the logits come from HF's output embedding on the rows troupe samples, with the head's
  scaling of the families that have one (Cohere's logit_scale, Granite's logits_scaling).

transformers_config.py decides at start-up which implementation runs and refuses what the
fallback cannot run."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from actors.config import ModelConfig
from actors.layers.attention import AttentionBackend
from actors.layers.attention_metadata import AttentionMetadata
from actors.layers.tensor_parallel import TensorParallel
from kernels.paged_attention_cpu import store_kv_cpu
from kernels.store_kv import store_kv, store_kv_ref

ATTENTION_NAME = "troupe"  # the name registered with transformers' AttentionInterface


class _Step:
    """What the attention function reads during one forward: set by TransformersModel.forward."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.attention: AttentionMetadata | None = None
        self.calls = 0  # attention calls this forward (a family that bypasses the interface makes none)


def troupe_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, heads, tokens, head_dim], key and value
    [1, kv_heads, tokens, head_dim], rotated; -> ([1, tokens, heads, head_dim], None). HF's mask
    is ignored: the step's AttentionMetadata says which cached tokens each query sees."""
    step: _Step = module.troupe_step
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{type(module).__name__}: sliding windows and soft caps do not run on the "
                                  "Transformers fallback")
    key_cache, value_cache = step.kv_caches[module.layer_idx]
    if key.shape[1] != key_cache.shape[1] or key.shape[-1] != key_cache.shape[-1]:
        raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}): {key.shape[1]} KV heads of "
                         f"{key.shape[-1]} features, but the KV cache was sized for {key_cache.shape[1]} of "
                         f"{key_cache.shape[-1]} from config.json")
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [tokens, heads, head_dim]
    backend, attention = step.backend, step.attention
    _store_kv(backend, k, v, key_cache, value_cache, attention.slot_mapping)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    step.calls += 1
    return backend.attention(q, k, v, key_cache, value_cache, attention, scale).unsqueeze(0), None


def _store_kv(backend: AttentionBackend, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # troupe's decoder stores inside rotary_store_kv; here HF has rotated already, so the
    # backend's plain store
    if backend.name == "cpu":
        store_kv_cpu(key, value, key_cache, value_cache, slot_mapping, backend.native)
    elif backend.name == "triton":
        store_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        store_kv_ref(key, value, key_cache, value_cache, slot_mapping)


def register_attention() -> None:
    """Registers troupe_attention under ATTENTION_NAME with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, troupe_attention)


def _renamer(hf_model: torch.nn.Module, params: dict[str, torch.Tensor]):
    """checkpoint name -> this model's, by transformers' renamings of the model's family. A
    family whose checkpoints transformers converts (fuses, splits) rather than renames is
    refused naming the weight: the fallback loads tensors one by one as they are."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # (a transformers without conversion mappings: names as they are)
        return lambda name: name
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(name: str) -> str:
        renamed, converter = rename_source_key(name, renamings, converters, hf_model.base_model_prefix, params)
        if converter is not None:
            raise ValueError(f"checkpoint weight {name!r}: transformers converts it ({converter!r}) on loading, "
                             "which the Transformers fallback does not")
        return renamed

    return rename


class TransformersModel:
    """The model runner's decoder interface (LlamaModel's: forward, compute_logits,
    load_weights, ...) over a transformers causal LM."""

    holds_embedding = True
    holds_head = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, parallel: TensorParallel = TensorParallel()) -> None:
        if parallel.enabled:  # (refused at start-up too: transformers_config.check_fallback_engine)
            raise ValueError("tensor_parallel_size: the Transformers fallback runs on one device")
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        register_attention()
        self.config, self.dtype, self.device, self.backend, self.parallel = config, dtype, device, backend, parallel
        self.num_heads, self.num_kv_heads, self.head_dim = \
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hf_config = AutoConfig.from_pretrained(config.model_path, trust_remote_code=False)
        hf_config._attn_implementation = ATTENTION_NAME
        # built in place on the device, uninitialised: the checkpoint's weights overwrite every parameter
        with torch.device(device), no_init_weights():
            self.hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=False,
                                                       attn_implementation=ATTENTION_NAME)
        self.hf.eval().requires_grad_(False)
        self.step = _Step(backend)
        for module in self.hf.modules():  # (the attention modules, and any other that knows its layer: harmless)
            if hasattr(module, "layer_idx"):
                module.troupe_step = self.step
        head_config = self.hf.config
        self.logit_scale = float(getattr(head_config, "logit_scale", None) or 1.0)  # Cohere
        self.logit_scale /= float(getattr(head_config, "logits_scaling", None) or 1.0)  # Granite
        self.final_softcap = getattr(head_config, "final_logit_softcapping", None)  # (Gemma's)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.hf.get_output_embeddings().weight

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes the checkpoint's tensors by their Hugging Face names, renamed as transformers'
        own loader renames them (its checkpoint conversion mapping: GPT-NeoX's embed_out is
        lm_head in transformers 5). The loader prefixes a name that lacks "model." with it (a
        bare body's), which this model's names may not have: both spellings are tried."""
        params = dict(self.hf.named_parameters())
        rename = _renamer(self.hf, params)
        loaded: set[str] = set()
        for name, tensor in weights:
            target = next((t for t in (rename(name), rename(name.removeprefix("model."))) if t in params), None)
            if target is None:
                if "rotary_emb" in name or name.endswith(("masked_bias", ".attn.bias", "inv_freq")):
                    continue  # buffers some checkpoints carry and the modules rebuild
                raise ValueError(f"checkpoint weight {name!r} is not a parameter of transformers' "
                                 f"{self.config.architecture}")
            param = params[target]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, transformers' "
                                 f"{self.config.architecture} expects {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(target)
        self._tie_and_check(loaded)

    def _tie_and_check(self, loaded: set[str]) -> None:
        self.hf.tie_weights()  # (a tied output embedding shares the input embedding's tensor)
        loaded_storage = {p.data_ptr() for n, p in self.hf.named_parameters() if n in loaded}
        missing = [n for n, p in self.hf.named_parameters() if n not in loaded and p.data_ptr() not in loaded_storage]
        if missing:
            raise ValueError(f"checkpoint is missing weight {missing[0]!r} of transformers' {self.config.architecture}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights, for benchmarks: normal(0, 0.02), norms' scales 1."""
        generator = torch.Generator(self.device).manual_seed(seed)
        with torch.no_grad():
            for name, param in self.hf.named_parameters():
                if "norm" in name:
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
        self.hf.tie_weights()

    def num_weight_bytes(self) -> int:
        tensors = {p.data_ptr(): p for p in self.hf.parameters()}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # -- forward ---------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(input_ids)

    def forward(self, input_ids: torch.Tensor,  # [num_tokens] int64
                positions: torch.Tensor,  # [num_tokens] int64
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attention: AttentionMetadata, lora=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:  # [num_tokens, hidden]
        """The step's tokens as one sequence of batch 1 through HF's body; the final hidden
        states (after its final norm). lora: refused at start-up, always None."""
        step = self.step
        step.kv_caches, step.attention, step.calls = kv_caches, attention, 0
        try:
            body = self.hf.base_model
            kwargs = {"inputs_embeds": inputs_embeds.unsqueeze(0)} if inputs_embeds is not None \
                else {"input_ids": input_ids.unsqueeze(0)}
            out = body(**kwargs, position_ids=positions.unsqueeze(0), use_cache=False, return_dict=True)
        finally:
            step.kv_caches, step.attention = [], None
        if step.calls != self.config.num_hidden_layers:
            raise NotImplementedError(
                f"{self.config.architecture}: {step.calls} attention calls through transformers' attention "
                f"interface for {self.config.num_hidden_layers} layers: its attention does not run on the "
                "Transformers fallback")
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        logits = self.hf.get_output_embeddings()(hidden).float()
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits[:, : self.config.vocab_size]
