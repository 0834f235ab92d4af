#!/bin/bash
# The GPU checks of issue #20 in one call of a lent GPU machine (its python3 has torch with
# CUDA; the packages it lacks travel as wheels in .whl, see /work/.library/device/README.md):
#   bash benchmarks/gpu_check.sh [stage...]    stages: tests kernels-all engine-tests suite-on-cuda attention decode
#                                              profile offline offline-8b serve serve-256 cache-save launch
#                                              structured async kernels-some (KERNEL_FILES) proofs hybrid
# A Triton cache from an earlier call (.gpu_cache/triton.tgz, carried) is unpacked first: the
# kernels' compilation is a large share of a short call; `cache-save` writes it to $OUT.
# Each stage runs under its own time limit, logs to $OUT/<stage>.log and prints its tail.
set -u
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
if [ -f .gpu_cache/triton.tgz ]; then tar -xzf .gpu_cache/triton.tgz -C "$HOME" && echo "triton cache restored"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
PYTEST="python3 -m pytest -q -p no:cacheprovider -p pytest_asyncio.plugin -p pytest_timeout -rfE --tb=short --maxfail=40"
KERNEL_TESTS="tests/kernels/test_paged_attention.py tests/kernels/test_store_kv.py tests/kernels/test_rms_norm.py
  tests/kernels/test_rotary.py tests/kernels/test_silu_mul.py tests/kernels/test_lora_kernels.py tests/kernels/test_quant_triton.py
  tests/kernels/test_quant_checkpoint_triton_path.py tests/kernels/test_token_bitmask.py tests/kernels/test_attention_backend.py
  tests/kernels/test_online_quantization.py tests/layers/test_sampler_device.py"

stage() {  # name, seconds, command...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name (limit ${limit}s; GPU memory used before: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader))"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "--- $name: rc=$? in $((SECONDS - start))s"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}

for part in "${@:-tests engine-tests attention decode offline}"; do for s in $part; do case $s in
    tests) stage tests "${T_TESTS:-110}" $PYTEST $KERNEL_TESTS ;;
    kernels-all) stage kernels-all "${T_KERNELS:-150}" $PYTEST -p xdist.plugin -n "${XDIST:-6}" tests/kernels ;;
    engine-tests) stage engine-tests "${T_ENGINE:-150}" $PYTEST tests/gpu --ignore-glob='*diag*' ;;
    attention) stage attention "${T_ATTENTION:-45}" python3 benchmarks/kernels.py --parts attention ;;
    decode) stage decode "${T_DECODE:-90}" python3 benchmarks/gpu_engine.py --parts decode --repeats "${DECODE_REPEATS:-3}" ;;
    fused) stage fused "${T_FUSED:-40}" python3 benchmarks/kernels.py --parts fused,splits,layer ;;
    profile) stage profile "${T_PROFILE:-60}" python3 benchmarks/gpu_engine.py --models llama-3.1-8b --parts profile ;;
    offline) stage offline "${T_OFFLINE:-90}" python3 benchmarks/gpu_engine.py --models qwen3-0.6b --parts offline \
        --hf --hf-num-requests "${HF_REQUESTS:-64}" --hf-batch-size "${HF_REQUESTS:-64}" ;;
    offline-8b) stage offline-8b "${T_OFFLINE:-90}" python3 benchmarks/gpu_engine.py --models llama-3.1-8b --parts offline ;;
    suite-on-cuda) TROUPE_TEST_DEVICE=cuda stage suite-on-cuda "${T_SUITE:-120}" $PYTEST --maxfail=30 \
        tests/models/test_llm_matches_hf.py tests/layers/test_llm_sampling.py tests/layers/test_logits_processors.py \
        tests/structured_output/test_structured_outputs.py tests/lora/test_lora.py tests/frontend/test_async_client.py \
        tests/worker/test_async_steps.py ;;
    serve) stage serve "${T_SERVE:-150}" python3 benchmarks/gpu_serve.py --max-concurrency 64 \
        ${HOST_PROFILE:+--host-profile "$OUT/worker_profile.txt"} ${SERVER_FLAGS:+--server-flags "$SERVER_FLAGS"} ;;
    launch) stage launch "${T_LAUNCH:-60}" python3 benchmarks/launch_overhead.py ;;
    structured) TROUPE_TEST_DEVICE=cuda stage structured "${T_STRUCTURED:-60}" $PYTEST tests/structured_output/test_structured_outputs.py ;;
    async) TROUPE_TEST_DEVICE=cuda stage async "${T_ASYNC:-60}" $PYTEST tests/worker/test_async_steps.py ;;
    kernels-some) stage kernels-some "${T_KERNELS:-90}" $PYTEST -p xdist.plugin -n "${XDIST:-6}" $KERNEL_FILES ;;
    serve-256) stage serve-256 "${T_SERVE:-150}" python3 benchmarks/gpu_serve.py --max-concurrency 256 --num-prompts 1024 ;;
    offline-8b-hf) stage offline-8b-hf "${T_OFFLINE:-120}" python3 benchmarks/gpu_engine.py --models llama-3.1-8b \
        --parts offline --hf --hf-num-requests "${HF_REQUESTS:-32}" --hf-batch-size "${HF_REQUESTS:-32}" ;;
    proofs) # the kernel tests and the engine test files on CUDA side by side (small memory each)
        (XDIST=${XDIST:-6}; stage kernels-all "${T_KERNELS:-150}" $PYTEST -p xdist.plugin -n "$XDIST" tests/kernels) &
        TROUPE_TEST_DEVICE=cuda stage cuda-engine-files "${T_SUITE:-120}" $PYTEST tests/worker/test_async_steps.py \
            tests/structured_output/test_structured_outputs.py tests/layers/test_llm_sampling.py
        wait ;;
    hybrid) # issue 39 on CUDA: windowed models with their KV groups under CUDA graphs, GPT-OSS's MXFP4 Triton experts
        stage hybrid "${T_HYBRID:-150}" $PYTEST tests/gpu/test_cuda_engine.py -k windowed tests/kernels/test_fused_moe_mxfp4.py ;;
    cache-save) tar -czf "$OUT/triton.tgz" -C "$HOME" .triton 2>/dev/null; ls -la "$OUT/triton.tgz" ;;
    *) echo "unknown stage $s" ;;
esac; done; done
