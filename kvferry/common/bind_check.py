"""Binding listening sockets: an error that names the setting when the address is taken, and a warning for
sockets bound beyond this machine (without CURVE, anyone who reaches the port can talk)."""

import errno
import logging
import os
import socket

import zmq

from kvferry.common.errors import ConfigError

log = logging.getLogger("kvferry.transport")
LOOPBACK = ("127.", "localhost", "[::1]", "::1")


def is_local(address: str) -> bool:
    """tcp://HOST:PORT on a loopback host, or an ipc:// or inproc:// address."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://") :].rsplit(":", 1)[0]
    return host.startswith(LOOPBACK)


def check_exposed(address: str, what: str, curve: bool = False, insecure: bool = False) -> None:
    if not curve and not is_local(address):
        log.warning(
            "%s binds %s, beyond this machine, without CURVE: any host that reaches it can send messages. "
            "Bind 127.0.0.1, or turn on --curve-keys",
            what,
            address,
        )


def _cannot_bind(address: str, setting: str, reason: str, in_use: bool) -> ConfigError:
    fix = (
        "another process holds it (another kvferry?): stop that one, or choose a free port"
        if in_use
        else "give an address of this machine, as tcp://HOST:PORT"
    )
    return ConfigError(f"{setting}: cannot listen on {address}: {reason}; {fix}")


def bind_zmq(sock: zmq.Socket, address: str, setting: str) -> None:
    """sock.bind, with a ConfigError naming the setting (its flag and variable: settings.label) when it fails."""
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise _cannot_bind(address, setting, os.strerror(exc.errno), exc.errno == errno.EADDRINUSE) from None


def listen_tcp(host: str, port: int, setting: str) -> socket.socket:
    """A listening TCP socket for an HTTP server, with the same errors as bind_zmq."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise _cannot_bind(f"{host}:{port}", setting, exc.strerror or str(exc), exc.errno == errno.EADDRINUSE) from None
    return sock
