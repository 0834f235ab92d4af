"""A local HTTP server on 127.0.0.1 for image_url tests: /image.png (a drawn PNG),
/slow.png (answers after SLOW_S), /big.png (more than the fetch size limit), anything else
404. Bounded: it serves until the context exits."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from actors.multimodal.fetch import MAX_IMAGE_BYTES

SLOW_S = 3.0


@contextlib.contextmanager
def image_server(image) -> Iterator[str]:
    """Yields the server's base URL (http://127.0.0.1:PORT)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    png = buffer.getvalue()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/slow.png":
                time.sleep(SLOW_S)
            body = {"/image.png": png, "/slow.png": png, "/big.png": b"\0" * (MAX_IMAGE_BYTES + 1)}.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a size or time limit)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
