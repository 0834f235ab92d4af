"""The scheduler's max_loras rule: how many distinct LoRA adapters a step may mix."""

from __future__ import annotations

from actors.scheduler.request import Sequence


class AdapterAdmission:
    """max_loras in one scheduling pass: the adapters of the running sequences (every one of
    them: a step holds at most max_loras, so a worker's slots always hold a step's adapters).
    A waiting sequence whose adapter is not among them waits while there are max_loras;
    later ones with a running adapter may overtake it, as vLLM's scheduler lets them, but
    only max_num_seqs times: then adapters stop being admitted until a slot frees, so a
    request for a new adapter never starves behind a stream of others."""

    def __init__(self, running: list[Sequence], max_loras: int, max_overtakes: int) -> None:
        self.max_loras = max_loras
        self.max_overtakes = max_overtakes
        self.running = {seq.lora_request.cache_key for seq in running if seq.lora_request is not None}
        self.waiting_for_slot: list[Sequence] = []  # held back for max_loras in this pass, oldest first

    def holds_back(self, seq: Sequence) -> bool:
        lora = seq.lora_request
        if lora is None:
            return False  # the base model takes no slot
        if lora.cache_key not in self.running and len(self.running) >= self.max_loras:
            self.waiting_for_slot.append(seq)
            return True
        return any(waiting.times_overtaken >= self.max_overtakes for waiting in self.waiting_for_slot)

    def admitted(self, seq: Sequence) -> None:
        seq.times_overtaken = 0
        if seq.lora_request is not None:
            self.running.add(seq.lora_request.cache_key)
            for waiting in self.waiting_for_slot:
                waiting.times_overtaken += 1
