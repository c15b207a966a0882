"""A real HTTP server on a free loopback port, on a thread of its own, for tests of clients (the SSE client, replay,
the OTLP exporter): each request goes to a fresh instance of the given handler class."""

import contextlib
import http.server
import threading


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]):
    """Yields the server's base URL (http://127.0.0.1:PORT); shuts it down and closes its socket on the way out."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
