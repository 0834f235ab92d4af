"""Speculative decoding, engine side: the n-gram and suffix proposers, the draft model
(draft_model.py, its start-up checks in draft_config.py), the verification (greedy
acceptance and rejection sampling: rejection.py) and the worker's proposer that runs them
each step (speculator.py). The config is actors/config/speculative.py; the scheduler's
grant of draft slots is actors/scheduler/speculation.py."""
