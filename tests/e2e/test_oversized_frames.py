"""One frame far past the size limit, sent from a raw ZeroMQ socket to each socket a process exposes (the gateway's
control ROUTER, a decode worker's KV ingress): ZeroMQ would buffer the whole frame before the process saw it, so
ZMQ_MAXMSGSIZE must turn it away at its length prefix. The receiver's peak memory does not grow by the frame's
size, and it goes on serving. Real processes, real sockets, real HTTP."""

import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from tests.e2e.stack import Stack, tiny_stack

pytestmark = pytest.mark.slow
FRAME_BYTES = 300 << 20  # past every limit of this stack: the gateway's largest header, the decode worker's KV group
GREEDY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("oversized")) as stack:
        yield stack.start_pair()


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (the peak since the process started) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}


def greedy_text(stack: Stack) -> str:
    status, reply = stack.post("/v1/completions", GREEDY, timeout=120)
    assert status == 200, reply
    return reply["choices"][0]["text"]


def send_one_frame(address: str, size: int, handled, timeout_s: float = 60) -> None:
    """Send one frame of `size` bytes and wait until the receiver dropped the connection (the limit works) or
    counted the frame as a protocol error (it took the whole frame in first)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(address)
        frame = bytes(size)  # calloc'd zero pages: sending them reads, and costs this process next to nothing
        sock.send(frame, copy=False)
        del frame
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if monitor.poll(200) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                return
            if handled():
                return
        raise AssertionError(f"{address}: the frame was neither refused nor handled in {timeout_s} s")
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


def check_frame_costs_no_memory(stack: Stack, process: str, address: str, errors) -> None:
    reference = greedy_text(stack)
    pid = stack.procs[process].pid
    before, errors_before = memory_kib(pid), errors()
    send_one_frame(address, FRAME_BYTES, lambda: errors() > errors_before)
    after = memory_kib(pid)
    grown_mib = {name: (after[name] - before[name]) / 1024 for name in after}
    # Old code: ZeroMQ buffered the whole frame, then decode copied it: the peak grew by one to two frames.
    assert grown_mib["VmHWM"] < FRAME_BYTES / 2**20 / 4, (process, before, after)
    assert grown_mib["VmRSS"] < FRAME_BYTES / 2**20 / 4, (process, before, after)
    assert greedy_text(stack) == reference
    assert all(proc.poll() is None for proc in stack.procs.values())


def test_an_oversized_frame_to_the_gateway_control_socket_costs_it_no_memory(stack):
    check_frame_costs_no_memory(
        stack, "gateway", stack.control, lambda: stack.get("/v1/workers")[1]["gateway"]["protocol_errors"]
    )


def test_an_oversized_frame_to_a_decode_kv_ingress_costs_it_no_memory(stack):
    kv_address = stack.workers()["decode-a"]["kv_address"]
    check_frame_costs_no_memory(stack, "decode-a", kv_address, lambda: stack.workers()["decode-a"]["protocol_errors"])
