"""The OpenAI-compatible HTTP API (Starlette), served by `python -m actors.launch`.

It reaches the engine only through a started AsyncClient. One module per concern:
protocol.py (request bodies) and responses.py (response bodies) as msgspec Structs,
errors.py (OpenAI-shaped errors), serving.py (what every endpoint shares: settings, body
reading, disconnects, SSE), engine_requests.py (the engine requests behind one HTTP
request, and back-pressure), serving_completions.py and serving_chat.py (the two
generation endpoints), metrics.py (Prometheus), middleware.py (API key, request log),
app.py (the routes)."""

from api.app import build_app
from api.serving import ServerSettings

__all__ = ["build_app", "ServerSettings"]
