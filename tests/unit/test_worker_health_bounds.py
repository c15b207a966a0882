"""The worker health port bounds its connections: each is shut down a deadline after it was accepted however it
trickles bytes, a new one past the limit takes the slot of the oldest, and a probe is still answered while many
clients hold connections open. Real sockets on 127.0.0.1 (and 127.0.0.2 for a second client host)."""

import contextlib
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


@contextlib.contextmanager
def health_server(idle_timeout_s: float, max_connections: int):
    """(the server, connect): connect(source host) opens a client connection to it; every connection and the server
    are closed after, whatever the test asserted."""
    server = WorkerHealthServer("127.0.0.1", 0, idle_timeout_s=idle_timeout_s, max_connections=max_connections)
    opened = []

    def connect(source: str = "127.0.0.1") -> socket.socket:
        opened.append(socket.create_connection(("127.0.0.1", server.port), source_address=(source, 0)))
        return opened[-1]

    try:
        yield server, connect
    finally:
        for sock in opened:
            sock.close()
        server.close()


def closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    sock.settimeout(wait_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_neither_pile_up_threads_nor_block_the_probe():
    with health_server(idle_timeout_s=1.0, max_connections=8) as (server, connect):
        before = threading.active_count()
        idle = [connect() for _ in range(NUM_IDLE)]
        idle[-1].sendall(b"GET /li")  # a request begun and never finished holds no thread past the timeout either
        time.sleep(0.5)
        assert threading.active_count() <= before + 8
        assert probe(server.port) == 503  # answered (the model is not loaded yet: not live)
        assert threading.active_count() <= before + 8
        # The excess were closed at once, the rest once idle for the timeout: none is held open for good.
        assert sum(closed_by_server(s, 10.0) for s in idle) == NUM_IDLE


def test_excess_connections_shut_the_oldest_promptly_and_slots_come_back():
    with health_server(idle_timeout_s=60.0, max_connections=4) as (server, connect):
        held = [connect() for _ in range(4)]
        time.sleep(0.3)
        held += [connect() for _ in range(10)]
        # Each new connection took the slot of the oldest, long before the 60 s timeout: the newest 4 hold them.
        assert [closed_by_server(s, 5.0) for s in held[:10]] == [True] * 10
        assert not any(closed_by_server(s, 0.2) for s in held[10:])
        for s in held:
            s.close()
        assert probe(server.port) == 503  # the slots freed by clients that left serve the probe


def test_a_client_trickling_bytes_is_dropped_at_the_connection_deadline():
    # Each byte arrives well within the per-read timeout: only a deadline for the whole connection ends it.
    with health_server(idle_timeout_s=1.5, max_connections=4) as (_, connect):
        sock = connect()
        for byte in b"GET /live HTTP/1.0":  # a byte about every second: 18 s unless dropped
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # the server shut the connection down under our write
                break
            if closed_by_server(sock, 1.0):  # also the pause between bytes
                break
        else:
            raise AssertionError("the connection outlived 18 s of trickled bytes")


def test_a_probe_is_answered_when_idle_connections_hold_every_slot():
    with health_server(idle_timeout_s=60.0, max_connections=4) as (server, connect):
        idle = [connect() for _ in range(4)]
        time.sleep(0.3)  # all four are being served, silent, far from their deadline
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/live")  # one try, no retry: the kubelet's probe
        assert conn.getresponse().status == 503  # answered (the model is not loaded yet: not live)
        conn.close()
        assert closed_by_server(idle[0], 5.0)  # the oldest made room for it
        assert not any(closed_by_server(s, 0.2) for s in idle[1:])


def test_the_connection_dropped_for_room_is_from_the_client_holding_the_most():
    # A prober on another address connected first; a client filling the rest of the slots loses its own.
    with health_server(idle_timeout_s=60.0, max_connections=4) as (_, connect):
        prober = connect("127.0.0.2")
        time.sleep(0.1)
        crowd = [connect() for _ in range(4)]
        assert closed_by_server(crowd[0], 5.0)
        assert not closed_by_server(prober, 0.3)
