"""The continuous-batching scheduler: which tokens of which sequences the next model
step computes, and what the sampled tokens mean.

Plain object, no sockets: the scheduler actor feeds it requests and StepResults and
sends the StepPlans it builds. schedule() builds a plan; update() applies a plan's result,
in plan order. Several plans may be in flight (async scheduling): a sequence that samples
in plan N decodes in plan N+1 a token the scheduler has not seen yet (a "pending" token;
the worker feeds its own sample), and a sequence found finished in result N has its extra
step's token discarded. add_request(), abort_request() and finish_sequence() may come at
any time.

Policy (as vLLM V1): running sequences first, in admission order (decodes and the rest
of chunked prefills), then waiting ones first-come-first-served, under a token budget
(max_num_batched_tokens) and a sequence cap (max_num_seqs). When a running sequence
needs a block and none is free, the newest running one is preempted: its blocks are freed
and it is recomputed later, or with a host KV tier swapped back in (kv_tiers.py).
"""

from __future__ import annotations

import time
from collections import deque

from actors.config import CacheConfig, SchedulerConfig
from actors.scheduler.encoder_budget import EncoderBudget
from actors.scheduler.in_flight import PlanInFlight, advance
from actors.config.kv_groups import KVCacheLayout
from actors.scheduler.hybrid_kv_cache import HybridKVCacheManager
from actors.scheduler.kv_cache_manager import KVCacheManager
from actors.scheduler.kv_tiers import KVTiers
from actors.scheduler.lora_admission import AdapterAdmission
from actors.scheduler.request import ExtraHashKeys, Sequence, SequenceStatus, check_prompt_fits, make_sequences
from actors.scheduler.speculation import DraftSlots
from actors.scheduler.stats import ITERATION_TOKENS_BOUNDS, CountHistogram, scheduler_stats
from actors.scheduler.updates import SchedulerUpdates
from actors.config.speculative import SpeculativeConfig
from messages.common import SamplingParams
from messages.frontend import HistogramSnapshot, PoolingResult
from messages.lora import LoRARequest
from messages.pooling import PER_TOKEN_TASKS, PoolingParams
from messages.worker import ContinuingRequest, NewRequest, StepPlan


class Scheduler(SchedulerUpdates):
    """Owns every live sequence and the KV-cache manager; builds StepPlans, applies StepResults."""
    kv_tiers: KVTiers | None = None  # the host KV tier, when there is one (make_scheduler sets it)
    encoder_budget: EncoderBudget | None = None  # image tokens one step may start encoding (make_scheduler sets it)
    skip_sampling_in_flight = False  # pipeline parallelism: plans in flight hold disjoint decodes

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 eos_token_ids: tuple[int, ...], max_loras: int = 0, pooling_type: str | None = None,
                 generates: bool = True, speculative: SpeculativeConfig | None = None,
                 kv_layout: KVCacheLayout | None = None) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.pooling_type = pooling_type  # the model's pooling (LAST, MEAN, CLS, ALL); None: no pooling requests
        self.generates = generates  # it has a language-model head: generation requests may come
        self.max_loras = max_loras  # distinct LoRA adapters among running sequences (0: LoRA off)
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.chunked_prefill = scheduler_config.enable_chunked_prefill  # off: a prompt runs whole, in one step
        self.max_model_len = scheduler_config.max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        # speculative decoding: drafts granted per decode, their KV slots and metrics (speculation.py)
        self.draft_slots = DraftSlots(speculative) if speculative is not None else None
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching) if kv_layout is None \
            or not kv_layout.hybrid else HybridKVCacheManager(
                num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, kv_layout,
                scheduler_config.max_num_batched_tokens)
        self.block_pool = self.kv_cache_manager.block_pool  # for inspection and reset_prefix_cache()
        # A sequence alone must always fit in the pool, or preempting it would not help
        # and it would wait forever: cap its length at the pool's capacity too.
        self.max_seq_len = min(self.max_model_len, self.kv_cache_manager.max_num_tokens)

        self.waiting: deque[Sequence] = deque()  # FCFS; preempted sequences go to the front
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.sequences: dict[str, Sequence] = {}  # seq_id -> live (waiting or running) sequence
        self._request_id_to_seq_ids: dict[str, list[str]] = {}  # live request -> seq ids by index
        # seq ids whose worker state must be dropped, for the next plan (dict: ordered set).
        self._ids_to_drop: dict[str, None] = {}
        # step_id -> what the plan asked of each sequence, for plans whose result is not applied yet
        self._in_flight: dict[int, PlanInFlight] = {}
        self._next_step_id = 0

        self.num_preemptions = 0
        self.num_computed_prefill_tokens = 0  # prompt tokens computed (recomputation included)
        # per step that produced tokens, as vLLM counts them: the tokens sampled, plus the
        # prompt of each request whose first token came
        self.iteration_tokens = CountHistogram(ITERATION_TOKENS_BOUNDS)
        self.pooling_results: list[PoolingResult] = []  # pooling requests finished, for take_pooling_results()

    # ---- requests in and out ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                    pooling_params: PoolingParams | None = None, priority: int = 0, mm_inputs: list | None = None) -> None:
        """Queues a request; params.n > 1 makes n sequences that share the prompt's blocks.
        A cache_salt keeps its prefix-cache entries apart from those of other salts (or
        none), as a LoRA adapter does from other adapters' and the base model's. A pooling
        request (pooling_params) runs its prompt and finishes with the worker's pooled output
        (take_pooling_results()). Raises ValueError when the request can never run."""
        if request_id in self._request_id_to_seq_ids:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        kv_cache = self.kv_cache_manager
        check_prompt_fits(len(prompt_token_ids), self.max_model_len, kv_cache.max_num_tokens,
                          f"{kv_cache.num_blocks} blocks of {kv_cache.block_size}", pooling_params is not None)
        if lora_request is not None and not self.max_loras:
            raise ValueError("LoRA adapters are off in this engine (enable_lora)")
        if pooling_params is not None and self.pooling_type is None:
            raise ValueError("this engine runs a generative model: pooling needs runner='pooling'")
        if pooling_params is None and not self.generates:
            raise ValueError("this engine runs a pooling model, which cannot generate text")
        if priority:  # PriorityScheduler (priority.py) orders by it; FCFS would ignore it
            raise ValueError(f"priority {priority} needs scheduling_policy 'priority' (this engine is FCFS)")
        adapter_id = lora_request.cache_key if lora_request is not None else None
        extra_hash_keys = ExtraHashKeys.of(adapter_id, cache_salt, mm_inputs)  # (images: their hashes too)
        sequences = make_sequences(request_id, prompt_token_ids, params, self.max_seq_len,
                                   kv_cache.enable_prefix_caching, extra_hash_keys)
        for seq in sequences:
            seq.stopping_token_ids = seq.params_stop_token_ids(self.eos_token_ids)
            seq.decodes_plainly = pooling_params is None and seq.params.logprobs is None
            seq.lora_request = lora_request
            seq.pooling_params = pooling_params
            seq.mm_inputs = mm_inputs
            seq.pools_every_token = pooling_params is not None and (
                self.pooling_type != "LAST" or pooling_params.task in PER_TOKEN_TASKS)
        for seq in sequences:
            if seq.seq_id in self.sequences:
                raise ValueError(f"request_id {request_id!r}: sequence id {seq.seq_id!r} is already live")
        for seq in sequences:
            self.sequences[seq.seq_id] = seq
            self.waiting.append(seq)
        self._request_id_to_seq_ids[request_id] = [seq.seq_id for seq in sequences]

    def abort_request(self, request_id: str) -> None:
        """Drops all of a request's sequences and their blocks; unknown ids are ignored."""
        for seq_id in list(self._request_id_to_seq_ids.get(request_id, ())):
            seq = self.sequences.get(seq_id)
            if seq is not None:
                self._retire(seq, "abort", None)

    def finish_sequence(self, request_id: str, index: int, finish_reason: str,
                        stop_reason: int | str | None) -> None:
        """Ends one completion the detokenizer found finished (a stop string); unknown ones are ignored."""
        seq_ids = self._request_id_to_seq_ids.get(request_id)
        if seq_ids is None or not 0 <= index < len(seq_ids):
            return
        seq = self.sequences.get(seq_ids[index])
        if seq is not None:
            self._retire(seq, finish_reason, stop_reason)

    def take_pooling_results(self) -> list[PoolingResult]:
        """The pooling requests finished since the last call."""
        results, self.pooling_results = self.pooling_results, []
        return results

    # ---- inspection ----

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def has_request(self, request_id: str) -> bool:
        """Whether the request has a live (waiting or running) sequence."""
        return request_id in self._request_id_to_seq_ids

    def has_pending_drops(self) -> bool:
        """Whether the next plan must tell the worker to drop some sequence's state."""
        return bool(self._ids_to_drop)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> dict[str, float | int | str | HistogramSnapshot]:
        return scheduler_stats(self)
    # ---- one step ----

    def schedule(self) -> StepPlan:
        """The next step's plan. Send it when it schedules tokens, lists ids to drop or has
        disk loads; update() must get the result of those that schedule tokens or load."""
        plan = _PlanParts()
        num_preemptions_before = self.num_preemptions
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        # after a preemption the pool is short: admitting now would just thrash
        if self.num_preemptions == num_preemptions_before:
            self._schedule_waiting(plan, budget)
        step_plan = StepPlan(step_id=self._next_step_id, new_requests=plan.new_requests,
                             continuing_requests=plan.continuing_requests,
                             num_scheduled_tokens=plan.num_scheduled_tokens,
                             finished_request_ids=list(self._ids_to_drop),
                             num_lookahead_tokens=plan.num_lookahead_tokens)
        if self.kv_tiers is not None:  # the step's copies between the tiers
            step_plan = self.kv_tiers.with_orders(step_plan)
        self._ids_to_drop.clear()
        self._next_step_id += 1
        if plan.in_flight.entries:
            self._in_flight[step_plan.step_id] = plan.in_flight
        return step_plan

    def _schedule_running(self, plan: _PlanParts, budget: int) -> int:
        """1. Running sequences first: each already holds KV, so advancing it frees its
        blocks soonest and keeps inter-token latency steady; a decode costs 1 token.
        Returns the budget left. The loop runs once per running sequence and step, so it
        reads each sequence's fields once and calls out only when something changes."""
        running, block_size = self.running, self.kv_cache_manager.block_size
        speculates = self.draft_slots is not None and self.draft_slots.step_allows(running)
        continuing_requests, num_scheduled_tokens = plan.continuing_requests, plan.num_scheduled_tokens
        entries, sampling_ids = plan.in_flight.entries, plan.in_flight.sampling_ids
        frees_windows = self.kv_cache_manager.frees_windows
        index = 0
        while index < len(running) and budget > 0:
            seq = running[index]
            index += 1
            num_pending = seq.num_pending_tokens
            num_total_tokens = len(seq.token_ids) + num_pending
            if num_pending and (num_total_tokens >= seq.max_num_tokens or self.skip_sampling_in_flight):
                continue  # it finishes when that result comes (under pipeline parallelism: its next input)
            num_computed = seq.num_computed_tokens
            num_new_tokens = num_total_tokens - num_computed
            if num_new_tokens > budget:
                num_new_tokens = budget
            if seq.mm_inputs and self.encoder_budget and not (num_new_tokens := self.encoder_budget.fit(
                    seq, num_computed, num_new_tokens, self._next_step_id)):
                continue  # its next image waits for a step with encoder budget left
            assert num_new_tokens > 0, f"running {seq} has nothing to compute"
            # a decode charges its drafts too; its slots cover where the worker may already be
            num_drafts = self.draft_slots.grant(seq, num_new_tokens, budget) if speculates else 0
            lookahead = seq.num_drafts_in_flight + num_drafts
            if frees_windows:  # a sliding group's blocks before this step's windows go back to the pool
                self.kv_cache_manager.free_out_of_window(seq)
            if num_computed + num_new_tokens + lookahead <= len(seq.block_ids) * block_size:
                new_block_ids = []  # most steps: its last block has room (allocate_slots would say so)
            elif (new_block_ids := self._grow(seq, num_new_tokens, lookahead)) is None:
                break  # seq was the newest running sequence: nothing after it to schedule
            assert seq.sent_to_worker, f"running {seq} unknown to the worker"
            continuing_requests.append(ContinuingRequest(seq.seq_id, new_block_ids, num_computed))
            num_scheduled_tokens[seq.seq_id] = num_new_tokens
            # in_flight.advance(), inline: the step's tokens count as computed now; reaching
            # the end, it samples a token the scheduler sees when the result comes
            seq.num_computed_tokens = num_computed + num_new_tokens
            samples = seq.num_computed_tokens == num_total_tokens
            if samples:
                seq.num_pending_tokens = num_pending + 1
                sampling_ids.add(seq.seq_id)
            if num_drafts:
                seq.num_drafts_in_flight += num_drafts
                plan.num_lookahead_tokens[seq.seq_id] = num_drafts
            entries.append((seq, seq.generation, num_computed, num_new_tokens, samples, num_drafts))
            budget -= num_new_tokens + num_drafts
        return budget

    def _grow(self, seq: Sequence, num_new_tokens: int, lookahead: int) -> list[int] | None:
        """A running sequence's new blocks for the step; while the pool is short, the newest
        running sequences are preempted (they have had the least service). None when seq
        itself was."""
        new_block_ids = self.kv_cache_manager.allocate_slots(seq, num_new_tokens, lookahead)
        while new_block_ids is None:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(seq, num_new_tokens, lookahead)
        return new_block_ids

    def _schedule_waiting(self, plan: _PlanParts, budget: int) -> None:
        """2. Waiting sequences, first come first served, while the budget, max_num_seqs and
        their blocks allow; ones that must wait (must_wait, max_loras) stay at the head."""
        held_back: list[Sequence] = []
        adapters = AdapterAdmission(self.running, self.max_loras, self.max_num_seqs) if self.max_loras else None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.must_wait(self._ids_to_drop) or (adapters is not None and adapters.holds_back(seq)):
                held_back.append(self.waiting.popleft())
                continue
            num_new_tokens = self._admit(seq, budget)
            if num_new_tokens is None:
                break  # the head does not fit; later ones must not overtake it
            self.waiting.popleft()
            self.running.append(seq)
            if adapters is not None:
                adapters.admitted(seq)
            plan.new_requests.append(NewRequest(
                request_id=seq.seq_id, token_ids=list(seq.token_ids),
                num_prompt_tokens=seq.num_prompt_tokens, params=seq.params,
                block_ids=self.kv_cache_manager.block_table(seq), num_computed_tokens=seq.num_computed_tokens,
                lora_request=seq.lora_request, pooling_params=seq.pooling_params, mm_inputs=seq.mm_inputs))
            seq.sent_to_worker = True
            advance(plan.in_flight, seq, num_new_tokens)
            plan.num_scheduled_tokens[seq.seq_id] = num_new_tokens
            budget -= num_new_tokens
        self.waiting.extendleft(reversed(held_back))

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Gives a waiting sequence its blocks (prefix-cache hits first) for its first
        chunk; the chunk's size, or None (and no change) when the pool is short."""
        hit_block_ids, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(seq)
        host_hits, num_host_tokens = self.kv_tiers.host_hits(seq, len(hit_block_ids), self.kv_cache_manager) \
            if self.kv_tiers is not None else ([], 0)
        if num_host_tokens < 0:  # its prefix is on its way from the disk tier (kv_tiers.py)
            return None
        num_left = seq.num_tokens - num_hit_tokens - num_host_tokens
        num_new_tokens = min(num_left, budget)
        if seq.mm_inputs and self.encoder_budget:  # images past the step's encoder budget wait
            num_new_tokens = self.encoder_budget.fit(seq, seq.num_tokens - num_left, num_new_tokens,
                                                     self._next_step_id, admitting=True)
        if not num_new_tokens or not self.chunked_prefill and num_new_tokens < num_left:
            return None
        new_block_ids = self.kv_cache_manager.allocate_slots(seq, num_host_tokens + num_new_tokens,
                                                             computed_block_ids=hit_block_ids)
        if new_block_ids is None:
            return None
        if self.kv_tiers is not None:  # host hits come back to the first new blocks
            self.kv_tiers.admitted(seq, host_hits, new_block_ids, num_hit_tokens)
        seq.num_computed_tokens = num_hit_tokens = num_hit_tokens + num_host_tokens
        if not seq.was_admitted:
            seq.num_cached_tokens = num_hit_tokens
            seq.first_scheduled_time = time.monotonic()
            seq.was_admitted = True
        seq.status = SequenceStatus.RUNNING
        return num_new_tokens

    def _preempt(self, seq: Sequence, recompute: bool = False) -> None:
        """Frees a running sequence (out of self.running): recomputed later, or swapped (kv_tiers.py)."""
        if self.kv_tiers is not None and not recompute:
            self.kv_tiers.swap_out(seq)
        self._release_blocks(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release_blocks(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_pending_tokens = 0  # lost with the KV: recomputed from the known tokens
        seq.num_drafts_in_flight = 0
        seq.generation += 1
        if seq.sent_to_worker:
            self._ids_to_drop[seq.seq_id] = None
            seq.sent_to_worker = False

    def _retire(self, seq: Sequence, finish_reason: str, stop_reason: int | str | None) -> None:
        """Finishes a live sequence: out of its queue, blocks freed, forgotten."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.finish(finish_reason, stop_reason)
        self._release_blocks(seq)
        if seq.swapped is not None:
            self.kv_tiers.drop_swapped(seq)
        del self.sequences[seq.seq_id]
        seq_ids = self._request_id_to_seq_ids[seq.request_id]
        if all(seq_id not in self.sequences for seq_id in seq_ids):
            del self._request_id_to_seq_ids[seq.request_id]


class _PlanParts:
    """The lists and maps of the plan being built, and what it asks of each sequence."""

    def __init__(self) -> None:
        self.new_requests: list[NewRequest] = []
        self.continuing_requests: list[ContinuingRequest] = []
        self.num_scheduled_tokens: dict[str, int] = {}
        self.num_lookahead_tokens: dict[str, int] = {}  # seq_id -> drafts granted (speculative decoding)
        self.in_flight = PlanInFlight()
