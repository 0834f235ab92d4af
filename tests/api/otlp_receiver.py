"""A minimal OpenTelemetry collector for tests: it takes OTLP trace exports on 127.0.0.1,
over HTTP/protobuf (POST /v1/traces) or gRPC, and keeps the spans it got."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _attribute_value(value):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class ReceivedSpan:
    def __init__(self, span) -> None:
        self.name = span.name
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_span_id = span.parent_span_id.hex()
        self.kind = span.kind
        self.start_ns, self.end_ns = span.start_time_unix_nano, span.end_time_unix_nano
        self.attributes = {a.key: _attribute_value(a.value) for a in span.attributes}


class OTLPReceiver:
    """Spans received, thread-safe; wait_for() blocks (bounded) until enough arrived."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def add(self, export_request) -> None:
        spans = [ReceivedSpan(span) for resource_spans in export_request.resource_spans
                 for scope_spans in resource_spans.scope_spans for span in scope_spans.spans]
        with self._lock:
            self.spans += spans

    def wait_for(self, count: int, timeout: float = 20.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"{len(self.spans)} spans arrived in {timeout} s, expected {count}")


def serve_http(receiver: OTLPReceiver):
    """(server, endpoint URL): an HTTP/protobuf collector; server.shutdown() stops it."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                           ExportTraceServiceResponse)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            receiver.add(request)
            payload = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


def serve_grpc(receiver: OTLPReceiver):
    """(server, endpoint): a gRPC collector; server.stop(0) stops it."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the protocol's name
            receiver.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}"
