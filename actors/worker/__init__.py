"""The worker role: one process a device, holding the model shard and the KV cache. The
model runner (model_runner.py, its step in runner_step.py) turns StepPlans into StepResults;
the actor shell is actor.py."""
