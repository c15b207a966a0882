"""A peer's ZeroMQ endpoint, checked where it enters: a worker's registration or a request, never inside a step."""

import re

import zmq

from kvferry.common.errors import InvalidRequest

PEER_ADDRESS = re.compile(r"tcp://[^\s:/]+:(?P<port>\d{1,5})|ipc://\S+|inproc://\S+")


def check_peer_address(address: str) -> None:
    """A tcp://host:port, ipc:// or inproc:// address that ZeroMQ accepts for a connect; InvalidRequest otherwise.

    The trial connect is what a prefill worker will do with it: an address ZeroMQ refuses (an unresolvable host,
    a malformed one) is refused here, once, rather than in every prefill that would send KV there."""
    match = PEER_ADDRESS.fullmatch(address) if isinstance(address, str) else None
    if match is None or match["port"] is not None and not 0 < int(match["port"]) < 65536:
        raise InvalidRequest(f"{address!r} is not a tcp://host:port, ipc:// or inproc:// address")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(address)
    except zmq.ZMQError as exc:
        raise InvalidRequest(f"{address!r} cannot be connected to: {exc}") from None
    finally:
        sock.close(linger=0)
