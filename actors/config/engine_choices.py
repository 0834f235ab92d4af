"""The engine arguments' choices and defaults (actors/engine/args.py's EngineArgs takes them):
torch-free constants on the config floor, so the flags' help and checks read them without
the engine."""

DTYPES, DEVICES, LOAD_FORMATS = ("auto", "float32", "bfloat16", "float16"), ("auto", "cpu", "cuda"), ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")  # actors/scheduler/priority.py
PREEMPTION_MODES = ("recompute", "swap")  # actors/scheduler/kv_tiers.py
MAY_BE_NONE = ("device", "reasoning_parser", "quantization", "collect_detailed_traces", "preemption_mode")
# the grammar library behind structured outputs: "auto" is xgrammar (actors/structured_output)
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
# how a reasoning model marks its thinking: <think>...</think> for both
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# the adapter ranks a LoRA slot may be sized for (vLLM's list)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# The server's step size when max_num_batched_tokens is not given. On the CPU a step's
# time grows with its tokens from a few dozen on (compute-bound), so a 2048-token prefill
# step stalls every decoding request for seconds (4.5 s on a 2-core EPYC); 512 cut the p99
# inter-token latency of benchmarks/serve_vs_offline.py's workload from 2.8 s to 1.4 s and
# the median time to first token from 4.8 s to 3.2 s at the same throughput (RESULTS.md).
# The offline LLM keeps 2048, as vLLM keeps a larger budget for its LLM class.
SERVER_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}
PYTHON_BATCHED_TOKENS = 2048
# The Python API's device when none is given: the CPU, in float32, where the tests and
# benchmarks compare it with references; the server's: a GPU when there is one.
PYTHON_DEVICE = "cpu"
SERVER_DEVICE = "auto"
