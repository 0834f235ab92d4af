"""A checked adapter's tensors, as one worker rank holds them: each adapted projection's
A [rank, in] and B [out, rank] with the scale folded into B, in the model's dtype, on the
host. Under tensor parallelism each rank reads only its slice, as the base layer is split
(actors/layers/tensor_parallel.py): a column-parallel projection (q/k/v, gate/up) keeps A whole
and its rows of B; a row-parallel one (o, down) its columns of A and B whole, so its
partial deltas are summed by the base layer's own all-reduce."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from actors.config import ModelConfig
from actors.lora.adapter_files import MODULES, AdapterSpec
from actors.layers.tensor_parallel import TensorParallel

ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass
class AdapterWeights:
    spec: AdapterSpec
    # (layer, module) -> (A [rank, in on this rank], B [out on this rank, rank] * scale)
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def load_adapter_weights(spec: AdapterSpec, model: ModelConfig, dtype: torch.dtype,
                         parallel: TensorParallel = TensorParallel()) -> AdapterWeights:
    modules = {}
    with safe_open(spec.weights_file, framework="pt") as file:
        for m in spec.modules:
            base_name = f"model.layers.{m.layer}.{MODULES[m.module]}.{m.module}.weight"
            a, b = file.get_slice(m.a_name), file.get_slice(m.b_name)
            if m.module in ROW_PARALLEL:
                a, b = parallel.shard(base_name, a, model), b[:]
            else:
                a, b = a[:], parallel.shard(base_name, b, model)
            # the scale folded into B in fp32, then the model's dtype
            modules[(m.layer, m.module)] = (a.to(dtype).contiguous(), (b.float() * m.scale).to(dtype).contiguous())
    return AdapterWeights(spec, modules)
