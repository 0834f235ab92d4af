"""A worker's adapter memory: max_loras slots on the model's device, which a step's
adapters must be in, and up to max_cpu_loras adapters loaded in host memory, both evicted
least recently used. The scheduler never mixes more than max_loras adapters in a step, so
a step's adapters always fit; an adapter that is in no slot is copied into one from host
memory (read from its files first when it is not there either).

Each layer's projections come in four groups that share an input (q/k/v, o, gate/up,
down). Per layer and group, slot s holds (kernels/lora_ref.py has the layout):
- a[s]: its modules' A matrices stacked, rows[s] rows in use;
- b[s]: its modules' B matrices (scaled) at the modules' output columns;
- per module, the A rows' offset and the rank (0: the adapter leaves that module alone)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from actors.config import LoRAConfig, ModelConfig
from actors.lora.adapter_files import read_adapter
from actors.lora.weights import AdapterWeights, load_adapter_weights
from actors.layers.tensor_parallel import TensorParallel
from messages.lora import LoRARequest

# a layer's groups of projections that share their input, in the forward's order
GROUPS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)), ("gate_up", ("gate_proj", "up_proj")),
          ("down", ("down_proj",)))
QKV, O, GATE_UP, DOWN = range(4)
MAX_GROUP_MODULES = 3


@dataclass(frozen=True)
class GroupShape:
    in_features: int  # on this rank
    outputs: tuple[tuple[int, int], ...]  # per module: (offset, size) of its columns of the group's output

    @property
    def out_features(self) -> int:
        return sum(size for _, size in self.outputs)


def group_shapes(model: ModelConfig, parallel: TensorParallel) -> tuple[GroupShape, ...]:
    """The four groups' shapes on this rank, as the model's fused weights are split."""
    hidden = model.hidden_size
    q, kv = parallel.num_heads(model) * model.head_dim, parallel.num_kv_heads(model) * model.head_dim
    inter = model.intermediate_size // parallel.size
    return (GroupShape(hidden, ((0, q), (q, kv), (q + kv, kv))), GroupShape(q, ((0, hidden),)),
            GroupShape(hidden, ((0, inter), (inter, inter))), GroupShape(inter, ((0, hidden),)))


class LoRASlots:
    def __init__(self, config: LoRAConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                 parallel: TensorParallel = TensorParallel()) -> None:
        self.config, self.model, self.dtype, self.device, self.parallel = config, model, dtype, device, parallel
        self.num_slots, self.max_rank = config.max_loras, config.max_lora_rank
        self.shapes = group_shapes(model, parallel)
        num_layers, slots, rank = model.num_hidden_layers, self.num_slots, self.max_rank
        # [layer][group] -> a [slots, modules * max_rank, in], b [slots, out, max_rank]
        self.a = [[torch.zeros(slots, len(modules) * rank, shape.in_features, dtype=dtype, device=device)
                   for (_, modules), shape in zip(GROUPS, self.shapes)] for _ in range(num_layers)]
        self.b = [[torch.zeros(slots, shape.out_features, rank, dtype=dtype, device=device)
                   for shape in self.shapes] for _ in range(num_layers)]
        # host copies decide what a step runs; the device copies feed the kernels
        self.rows = np.zeros((num_layers, len(GROUPS), slots), dtype=np.int32)
        # [layer, group, module, slot]: one module's values for every slot are contiguous
        self.col_offset = np.zeros((num_layers, len(GROUPS), MAX_GROUP_MODULES, slots), dtype=np.int32)
        self.rank = np.zeros((num_layers, len(GROUPS), MAX_GROUP_MODULES, slots), dtype=np.int32)
        self.device_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = self._meta_on_device()
        self._slot_of: OrderedDict[tuple[int, str], int] = OrderedDict()  # (id, path) -> slot, oldest use first
        self._host: OrderedDict[tuple[int, str], AdapterWeights] = OrderedDict()  # least recently used first
        self.num_loads = 0  # adapters read from their files
        self.num_slot_writes = 0  # adapters copied into a slot

    def slots_for(self, loras: list[LoRARequest]) -> dict[tuple[int, str], int]:
        """The slot of each of a step's adapters, copying in those not resident (least
        recently used slots first, never one this step needs)."""
        needed = list(dict.fromkeys((lora.lora_int_id, lora.lora_path) for lora in loras))
        if len(needed) > self.num_slots:
            raise RuntimeError(f"a step mixes {len(needed)} LoRA adapters; max_loras is {self.num_slots}")
        for key in needed:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
        wrote = False
        for lora in {(lora.lora_int_id, lora.lora_path): lora for lora in loras}.values():
            key = (lora.lora_int_id, lora.lora_path)
            if key in self._slot_of:
                continue
            used = set(self._slot_of.values())
            free = [slot for slot in range(self.num_slots) if slot not in used]
            if free:
                slot = free[0]
            else:
                victim = next(k for k in self._slot_of if k not in needed)
                slot = self._slot_of.pop(victim)
            self._write(slot, self._host_weights(lora))
            self._slot_of[key] = slot
            wrote = True
        if wrote:
            self.device_meta = self._meta_on_device()
        return {key: self._slot_of[key] for key in needed}

    def _host_weights(self, lora: LoRARequest) -> AdapterWeights:
        key = (lora.lora_int_id, lora.lora_path)
        weights = self._host.get(key)
        if weights is None:
            spec = read_adapter(lora, self.model, self.max_rank)
            weights = load_adapter_weights(spec, self.model, self.dtype, self.parallel)
            self.num_loads += 1
            while len(self._host) >= self.config.max_cpu_loras:
                self._host.popitem(last=False)
            self._host[key] = weights
        self._host.move_to_end(key)
        return weights

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        self.num_slot_writes += 1
        for layer in range(self.model.num_hidden_layers):
            for group, ((_, modules), shape) in enumerate(zip(GROUPS, self.shapes)):
                a, b = self.a[layer][group][slot], self.b[layer][group][slot]
                a.zero_()
                b.zero_()
                row = 0
                for index, (module, (out_offset, out_size)) in enumerate(zip(modules, shape.outputs)):
                    pair = weights.modules.get((layer, module))
                    rank = 0 if pair is None else pair[0].shape[0]
                    if pair is not None:
                        a[row:row + rank].copy_(pair[0])
                        b[out_offset:out_offset + out_size, :rank].copy_(pair[1])
                    self.col_offset[layer, group, index, slot] = row
                    self.rank[layer, group, index, slot] = rank
                    row += rank
                self.rows[layer, group, slot] = row

    def _meta_on_device(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows, col_offset, rank as tensors on the device (on the CPU: views of the arrays)."""
        return tuple(torch.from_numpy(array).to(self.device) for array in (self.rows, self.col_offset, self.rank))
