"""A local HTTP server on 127.0.0.1 for image_url tests: /image.png (a drawn PNG),
/slow.png (answers after SLOW_S), /big.png (more than the fetch size limit), /image.bmp (a
BMP, a format requests may not send), redirects (/to-localhost: to /image.png on
localhost; /to-ip: to /image.png on 127.0.0.1; /to-ftp: to an ftp:// URL; /loop: to
itself), anything else 404. Every path asked for is recorded in `hits`. Bounded: it serves
until the context exits."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from actors.multimodal.fetch import MAX_IMAGE_BYTES

SLOW_S = 3.0


@dataclass
class ImageServer:
    url: str  # http://127.0.0.1:PORT
    port: int
    hits: list[str] = field(default_factory=list)  # the paths asked for, in order

    @property
    def localhost_url(self) -> str:
        return f"http://localhost:{self.port}"


@contextlib.contextmanager
def image_server(image) -> Iterator[ImageServer]:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    png = buffer.getvalue()
    buffer = io.BytesIO()
    image.save(buffer, format="BMP")
    bmp = buffer.getvalue()
    served: ImageServer | None = None

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            served.hits.append(self.path)
            redirects = {"/to-localhost": f"{served.localhost_url}/image.png", "/to-ip": f"{served.url}/image.png",
                         "/to-ftp": f"ftp://localhost:{served.port}/image.png", "/loop": "/loop"}
            if self.path in redirects:
                self.send_response(302)
                self.send_header("Location", redirects[self.path])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path == "/slow.png":
                time.sleep(SLOW_S)
            body = {"/image.png": png, "/slow.png": png, "/image.bmp": bmp,
                    "/big.png": b"\0" * (MAX_IMAGE_BYTES + 1)}.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/bmp" if self.path.endswith(".bmp") else "image/png")
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
    port = server.server_address[1]
    served = ImageServer(f"http://127.0.0.1:{port}", port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
