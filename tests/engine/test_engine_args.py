"""EngineArgs, written once: every field is a launcher flag and a keyword of LLM and
AsyncClient with the same default; the fields left None take each entry point's value in
one place; and the API server process (engine arguments, launcher, app, AsyncClient)
runs without torch."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from actors.config import cuda_flags as cuda_args_module
from actors.config import parse_size
from actors.config.cli_flags import cuda_device_count
from actors.engine.args import EngineArgs
from api.server import build_parser, engine_args, parse_args

REPO_ROOT = Path(__file__).resolve().parents[2]
FIELD_NAMES = [spec.name for spec in dataclasses.fields(EngineArgs)]


def test_every_field_is_a_flag_whose_default_is_the_keywords_default():
    help_text = build_parser().format_help()
    for name in FIELD_NAMES:
        assert "--" + name.replace("_", "-") in help_text
    assert EngineArgs.from_cli_args(parse_args([])) == EngineArgs()


def test_flags_set_the_fields_of_the_same_name(monkeypatch):
    monkeypatch.setenv("TROUPE_ENGINE_KEY", "k" * 32)  # --nnodes 2: the nodes' shared secret (else refused)
    args = EngineArgs.from_cli_args(parse_args([
        "--model", "/models/x", "--max-num-seqs", "7", "--kv-cache-memory", "1GiB", "--num-kv-blocks", "40",
        "--dtype", "bfloat16", "--device", "cuda", "--gpu-memory-utilization", "0.5", "--no-async-scheduling",
        "--max-logprobs", "3", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"]))
    assert (args.model, args.max_num_seqs, args.kv_cache_memory, args.num_kv_blocks) == ("/models/x", 7, 2**30, 40)
    assert (args.dtype, args.device, args.gpu_memory_utilization) == ("bfloat16", "cuda", 0.5)
    assert (args.async_scheduling, args.max_logprobs) == (False, 3)
    assert (args.tensor_parallel_size, args.nnodes, args.node_rank) == (2, 2, 1)
    speculative = EngineArgs.from_cli_args(parse_args(["--speculative-config", '{"method": "suffix"}']))
    assert speculative.speculative_config == '{"method": "suffix"}'


def test_cuda_graph_flags_and_the_kv_cache_default():
    graphs = EngineArgs.from_cli_args(parse_args(["--cuda-graph-sizes", "4,1,2,300", "--max-num-seqs", "64"]))
    assert graphs.build().cuda_graph_sizes == (1, 2, 4)  # sorted; sizes past max_num_seqs dropped
    assert EngineArgs(max_num_seqs=20).build().cuda_graph_sizes == (1, 2, 4, 8, 16, 20)
    assert EngineArgs(max_num_seqs=1000).build().cuda_graph_sizes[-3:] == (496, 504, 512)
    assert EngineArgs.from_cli_args(parse_args(["--enforce-eager"])).build().cuda_graph_sizes == ()
    with pytest.raises(ValueError, match="cuda_graph_sizes must be a list of positive integers"):
        EngineArgs(cuda_graph_sizes=[2, -1]).build()
    # mixed steps (prefill chunks and decodes) get graphs too, every 32 tokens up to 512 or the step budget
    assert EngineArgs(max_num_batched_tokens=256).build().cuda_graph_mixed_sizes == tuple(range(32, 257, 32))
    assert EngineArgs().build().cuda_graph_mixed_sizes[-1] == 512
    decode_only = EngineArgs.from_cli_args(parse_args(["--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}']))
    assert (decode_only.build().cuda_graph_mixed_sizes, decode_only.build().cuda_graph_sizes[-1]) == ((), 256)
    small = EngineArgs(compilation_config={"max_cudagraph_capture_size": 64}).build()
    assert (small.cuda_graph_sizes[-1], small.cuda_graph_mixed_sizes) == (64, (32, 64))
    none = EngineArgs(compilation_config={"cudagraph_mode": "NONE"}).build()
    assert (none.cuda_graph_sizes, none.cuda_graph_mixed_sizes) == ((), ())
    for bad, field in (({"level": 3}, "level not supported"), ({"cudagraph_mode": "PIECEWISE"}, "cudagraph_mode"),
                       ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size"), ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=field):
            EngineArgs(compilation_config=bad).build()
    # on the CPU the KV cache keeps its 2 GiB; on CUDA the GPU's share (tests/gpu)
    cpu = EngineArgs(device="cpu").build().cache
    assert (cpu.kv_cache_memory, cpu.gpu_memory_utilization) == (parse_size("2GiB"), None)


@pytest.mark.parametrize("flags, message", [
    (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
    (["--max-logprobs", "-1"], "max_logprobs must be a non-negative integer"),
    (["--num-kv-blocks", "0"], "num_kv_blocks must be a positive integer"),
    (["--tensor-parallel-size", "2", "--nnodes", "3"], "nnodes (3) must divide tensor_parallel_size (2)"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "method must be one of"),
])
def test_a_bad_engine_flag_is_a_usage_error_before_anything_starts(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_llm_and_async_client_show_the_fields_as_keywords_with_the_same_defaults():
    from actors import LLM, AsyncClient

    for entry_point in (LLM, AsyncClient):
        parameters = inspect.signature(entry_point).parameters
        for spec in dataclasses.fields(EngineArgs):
            assert parameters[spec.name].default == spec.default, (entry_point, spec.name)


def test_an_unknown_keyword_is_a_type_error_naming_it():
    from actors import LLM, AsyncClient

    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'max_num_seq'"):
        LLM(max_num_seq=4)
    with pytest.raises(TypeError, match=r"AsyncClient\(\) got an unexpected keyword argument 'no_prefix_caching'"):
        AsyncClient(no_prefix_caching=True)


def test_unset_device_and_step_size_mean_auto_for_the_server_and_the_cpu_for_python(tiny_llama_dir, monkeypatch):
    for num_gpus, server_tokens in ((0, 512), (1, 2048)):
        monkeypatch.setattr(cuda_args_module, "cuda_device_count", lambda: num_gpus)
        server = engine_args(parse_args(["--model", tiny_llama_dir]))
        assert (server["device"], server["max_num_batched_tokens"]) == ("auto", server_tokens)
        # on a GPU the KV cache is sized from its memory unless a size is given
        assert server["gpu_memory_utilization"] == (0.9 if num_gpus else None)
        # the Python API runs on the CPU with 2048-token steps, GPU or not
        config = EngineArgs(model=tiny_llama_dir).build()
        assert (config.device, config.dtype, config.scheduler.max_num_batched_tokens) == ("cpu", "auto", 2048)
    assert engine_args(parse_args(["--device", "cuda"]))["max_num_batched_tokens"] == 2048
    config = EngineArgs(model=tiny_llama_dir, device="cuda", max_num_batched_tokens=64).build()
    assert (config.device, config.scheduler.max_num_batched_tokens) == ("cuda", 64)


def test_the_driver_query_agrees_with_torch_on_whether_there_is_a_gpu():
    assert (cuda_device_count() > 0) == torch.cuda.is_available()


def test_the_api_server_process_runs_without_torch(tiny_llama_dir):
    # what `python -m actors.launch` imports and does before it starts the engine's
    # processes: parse the flags (device "auto" included), build the engine config, the app
    script = textwrap.dedent(f"""
        import sys
        import actors.launch, api.server_flags, actors.frontend.client, api.app
        from actors.engine.args import EngineArgs
        from actors.launch import engine_args, parse_args
        from actors.frontend.client import AsyncClient
        args = engine_args(parse_args(["--model", {tiny_llama_dir!r}, "--device", "auto"]))
        EngineArgs(**args).build()
        AsyncClient(**args)
        loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
        assert not loaded, loaded
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
