"""The worker health port bounds its connections: idle clients time out, excess ones are closed at once, and a probe
is still answered while many clients hold connections open. Real sockets on 127.0.0.1."""

import http.client
import socket
import threading
import time

from kvferry.services.worker_health import WorkerHealthServer

NUM_IDLE = 60


def probe(port: int, deadline_s: float = 20.0) -> int:
    """The status of GET /live, retrying a refused or dropped connection as a kubelet's next probe would."""
    until = time.monotonic() + deadline_s
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/live")
            status = conn.getresponse().status
            conn.close()
            return status
        except OSError:
            if time.monotonic() > until:
                raise
            time.sleep(0.1)


def closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    sock.settimeout(wait_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_neither_pile_up_threads_nor_block_the_probe():
    server = WorkerHealthServer("127.0.0.1", 0, idle_timeout_s=1.0, max_connections=8)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(NUM_IDLE)]
    try:
        idle[-1].sendall(b"GET /li")  # a request begun and never finished holds no thread past the timeout either
        time.sleep(0.5)
        assert threading.active_count() <= before + 8
        assert probe(server.port) == 503  # answered (the model is not loaded yet: not live)
        assert threading.active_count() <= before + 8
        # The excess were closed at once, the rest once idle for the timeout: none is held open for good.
        assert sum(closed_by_server(s, 10.0) for s in idle) == NUM_IDLE
    finally:
        for s in idle:
            s.close()
        server.close()


def test_excess_connections_are_closed_promptly_and_slots_come_back():
    server = WorkerHealthServer("127.0.0.1", 0, idle_timeout_s=60.0, max_connections=4)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        time.sleep(0.3)
        extra = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
        assert sum(closed_by_server(s, 5.0) for s in extra) == 10  # long before the 60 s timeout
        for s in idle:
            s.close()
        assert probe(server.port) == 503  # the slots freed by clients that left serve the probe
    finally:
        for s in idle + extra:
            s.close()
        server.close()
