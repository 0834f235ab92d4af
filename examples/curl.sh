#!/usr/bin/env bash
# Talk to a running server with curl. Start one first:
#     .venv/bin/python -m actors.launch            # the embedded SmolLM2 on 127.0.0.1:8000
# then: bash examples/curl.sh   (URL=http://host:port and API_KEY=... if the server has --api-key)
set -euo pipefail
URL="${URL:-http://127.0.0.1:8000}"
AUTH=()
if [[ -n "${API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer ${API_KEY}"); fi

echo "== the models served"
curl -sS "${AUTH[@]}" "$URL/v1/models"; echo

echo "== a completion (greedy, 24 tokens)"
curl -sS "${AUTH[@]}" "$URL/v1/completions" -H "Content-Type: application/json" \
  -d '{"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}'; echo

echo "== a chat completion, streamed as Server-Sent Events, with usage at the end"
curl -sSN "${AUTH[@]}" "$URL/v1/chat/completions" -H "Content-Type: application/json" \
  -d '{"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 48,
       "stream": true, "stream_options": {"include_usage": true}}'

echo "== health (200 while every actor is alive) and a few metrics"
curl -sS -o /dev/null -w "%{http_code}\n" "$URL/health"
curl -sS "$URL/metrics" | grep -E "^vllm:(num_requests|kv_cache_usage|generation_tokens_total)"
