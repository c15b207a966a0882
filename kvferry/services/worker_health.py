"""A worker's health over HTTP (`--health-port`), for Kubernetes probes and `kvferry health`.

`GET /live`: 200 while the step loop comes round (503 once stuck for the stall timeout, and while the model loads).
`GET /health`: 200 when registered with a gateway and stepping; 503 while it loads, registers, drains or is stuck.
It listens before the model loads (a taken port fails at once), on its own thread.

The port listens on every interface, so at most MAX_CONNECTIONS are served at once, each shut down IDLE_TIMEOUT_S
after it was accepted (a timeout per read would let a byte every few seconds hold a slot for good). When every slot
is taken, the oldest connection of the client holding the most is shut down for the new one: refusing new ones
would let whoever holds the slots fail the kubelet's liveness probe. A probe sends its request as it connects and
is answered in milliseconds, so it gets through.
"""

import contextlib
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvferry.common import settings
from kvferry.common.bind_check import listen_tcp

PATHS = ("/health", "/live")
IDLE_TIMEOUT_S = 5.0  # a kubelet probe times out after 1 s by default; no connection holds a slot longer
MAX_CONNECTIONS = 16  # probes come one at a time per prober; a few probers and `kvferry health` fit


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, bounded in number and in time, as the module says."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int, timeout_s: float):
        super().__init__(address, handler, bind_and_activate=False)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.served = {}  # request -> (deadline, client host), oldest first

    def process_request(self, request, client_address):
        deadline = time.monotonic() + self.timeout_s
        if not self.slots.acquire(blocking=False):
            self.drop_one()
            # A shut-down connection's thread sees the end of its input and ends at once, giving back its slot.
            if not self.slots.acquire(timeout=1.0):
                self.shutdown_request(request)
                return
        with self.lock:
            self.served[request] = (deadline, client_address[0])
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: the slot would never come back
            self.forget(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.forget(request)

    def forget(self, request) -> None:
        with self.lock:
            self.served.pop(request, None)
        self.slots.release()

    def drop_one(self) -> None:
        """Shut down the oldest connection of the client host holding the most: not a prober's from elsewhere."""
        with self.lock:
            if not self.served:
                return  # all are already shut down and ending
            hosts = [host for _, host in self.served.values()]
            most = max(hosts.count(host) for host in hosts)
            victim = next(r for r, (_, host) in self.served.items() if hosts.count(host) == most)
            self.served.pop(victim)
        shut(victim)

    def service_actions(self) -> None:
        # Run by serve_forever every 0.5 s: connections past their deadline are shut down, ending a read under way.
        now = time.monotonic()
        with self.lock:
            late = [r for r, (deadline, _) in self.served.items() if deadline <= now]
            for request in late:
                self.served.pop(request)
        for request in late:
            shut(request)

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a client gone or shut down mid-reply: nothing to log
            super().handle_error(request, client_address)


def shut(request: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by its thread
        request.shutdown(socket.SHUT_RDWR)


def worker_state(worker) -> dict:
    """What the probes report, read from the worker's loop without locks (plain attribute reads)."""
    if worker is None:
        return {"status": "loading", "live": False, "ready": False}
    stuck_s = time.monotonic() - worker.loop_at
    live = stuck_s < worker.stall_timeout_s and worker.running
    registered = [link.address for link in worker.links if link.registered]
    if not live:
        status = "stuck" if worker.running else "stopped"
    elif worker.stop_requested:
        status = "draining"
    elif not registered:
        status = "registering"
    else:
        status = "ok"
    return {
        "status": status,
        "live": live,
        "ready": status == "ok",
        "worker_id": worker.worker_id,
        "role": worker.role.name.lower(),
        "registered_with": registered,
        "loop_age_s": round(stuck_s, 3),
        "stall_timeout_s": worker.stall_timeout_s,
    }


class WorkerHealthServer:
    def __init__(
        self, host: str, port: int, idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS
    ):
        self.worker = None  # set once the model has loaded
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = idle_timeout_s  # for each read and write; the server's deadline bounds the whole connection

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path not in PATHS:
                    return self._reply(404, {"error": f"no such path; try {' or '.join(PATHS)}"})
                state = worker_state(owner.worker)
                ok = state["live"] if path == "/live" else state["ready"]
                self._reply(200 if ok else 503, state)

            def _reply(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # probes every few seconds would flood the log
                pass

        sock = listen_tcp(host, port, settings.label("health_port"))
        self.server = BoundedHTTPServer((host, port), Handler, max_connections, idle_timeout_s)
        self.server.socket.close()
        self.server.socket = sock
        self.port = sock.getsockname()[1]
        threading.Thread(target=self.server.serve_forever, name="health", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
