"""Request tracing: OpenTelemetry spans of finished requests (spans.py)."""
