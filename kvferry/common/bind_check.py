"""Binding listening sockets: an error that names the setting when the address is taken, and a refusal of ZeroMQ
sockets bound beyond this machine without CURVE (anyone who reaches the port could register as a worker, or send KV),
and of the HTTP API bound beyond it without an API key (anyone who reaches the port could use the model), unless
--insecure says that the network is private."""

import errno
import ipaddress
import logging
import os
import socket

import zmq

from kvferry.common import settings
from kvferry.common.errors import ConfigError

log = logging.getLogger("kvferry.transport")


def is_local(address: str) -> bool:
    """An ipc:// or inproc:// address, or one whose host is loopback (127.0.0.0/8, ::1, localhost)."""
    transport, _, rest = address.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    return is_loopback_host(rest.split("/", 1)[0].rsplit(":", 1)[0])  # tcp://HOST:PORT, ws://HOST:PORT/path


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 (bracketed or not) or localhost."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "", an interface name, a host name or *: it may well reach beyond this machine


def check_exposed(address: str, what: str, curve: bool = False, insecure: bool = False) -> None:
    """A ZeroMQ socket bound beyond loopback needs CURVE: refused without it, unless insecure (then a loud warning).
    The HTTP API's counterpart, with the API key for CURVE, is check_http_exposed."""
    if curve or is_local(address):
        return
    if not insecure:
        raise ConfigError(
            f"{what} would listen on {address}, beyond this machine, without CURVE: anyone who reaches the port could "
            f"send it messages. Turn on CURVE with {settings.label('curve_keys')} (write the keys once with `kvferry "
            f"keys DIR`), or bind 127.0.0.1, or, on a private network you trust, pass {settings.label('insecure')}"
        )
    log.warning(
        "INSECURE (%s): %s listens on %s, beyond this machine, without CURVE: any host that reaches it can send "
        "messages, register as a worker or send KV. Only on a private network you trust; else give %s",
        settings.label("insecure"),
        what,
        address,
        settings.label("curve_keys"),
    )


def check_http_exposed(host: str, port: int, api_key: str | None, insecure: bool = False) -> None:
    """The HTTP API bound beyond loopback needs an API key: refused without one, unless insecure (then a loud
    warning). Checked before the model loads, so that the refusal comes at once."""
    if api_key or is_loopback_host(host):
        return
    address = f"{host}:{port}"
    if not insecure:
        raise ConfigError(
            f"the HTTP API would listen on {address}, beyond this machine, without an API key: anyone who reaches the "
            f"port could use the model and see the workers. Set {settings.label('api_key')} (a long random string, "
            f"e.g. from `openssl rand -hex 32`), or listen on 127.0.0.1 ({settings.label('host')}), or, on a private "
            f"network you trust, pass {settings.label('insecure')}"
        )
    log.warning(
        "INSECURE (%s): the HTTP API listens on %s, beyond this machine, without an API key: any host that reaches it "
        "can use the model. Only on a private network you trust; else give %s",
        settings.label("insecure"),
        address,
        settings.label("api_key"),
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


def listen_tcp(host: str, port: int, setting: str, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket for an HTTP server, with the same errors as bind_zmq. reuse_port: one of several
    processes' sockets on the same port (SO_REUSEPORT, set before the bind), among which the kernel spreads new
    connections; check_port_free first, or the socket would join any other group of this user's on that port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise _cannot_bind(f"{host}:{port}", setting, exc.strerror or str(exc), exc.errno == errno.EADDRINUSE) from None
    return sock


def check_port_free(host: str, port: int, setting: str) -> None:
    """A ConfigError naming the setting when a socket listens on host:port already (one with SO_REUSEPORT too: a bind
    without it fails there). A host that cannot be bound for another reason passes: its own bind reports that."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the real bind: TIME_WAIT is no obstacle
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise _cannot_bind(f"{host}:{port}", setting, exc.strerror, True) from None
