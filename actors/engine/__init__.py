"""Engine assembly: EngineArgs (args.py: keywords and flags -> EngineConfig), the actor
processes' supervisor (supervisor.py, addresses.py), the Ray executor (ray_executor.py), and
the whole engine in one process for the offline LLM (core.py)."""
