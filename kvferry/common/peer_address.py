"""A peer's ZeroMQ endpoint, checked where it enters: a worker's registration or a request, never inside a step."""

import ipaddress
import re

from kvferry.common.errors import InvalidRequest

MAX_PORT = 65535  # TCP's port field is 16 bits
TCP = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>\d{1,5})")
HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
LOCAL = re.compile(r"(ipc|inproc)://\S+")


def _is_host(host: str) -> bool:
    """An IP address (IPv6 in brackets) or a DNS name: what a ZeroMQ connect can resolve."""
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
        return True
    except ValueError:
        pass
    return not host.startswith("[") and len(host) <= 253 and all(HOST_LABEL.fullmatch(x) for x in host.split("."))


def check_peer_address(address: str) -> None:
    """A tcp://host:port, ipc:// or inproc:// address a ZeroMQ connect accepts; InvalidRequest otherwise. Checked
    by its form alone: dialing it would reach a peer that must not see a connection without its keys."""
    if isinstance(address, str) and LOCAL.fullmatch(address):
        return
    match = TCP.fullmatch(address) if isinstance(address, str) else None
    if match is None or not _is_host(match["host"]) or not 0 < int(match["port"]) <= MAX_PORT:
        raise InvalidRequest(f"{address!r} is not a tcp://host:port, ipc:// or inproc:// address")
