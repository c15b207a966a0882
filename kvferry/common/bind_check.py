"""A warning for sockets bound beyond this machine: without CURVE, anyone who reaches the port can talk."""
import logging

log = logging.getLogger("kvferry.transport")
LOOPBACK = ("127.", "localhost", "[::1]", "::1")


def is_local(address: str) -> bool:
    """tcp://HOST:PORT on a loopback host, or an ipc:// or inproc:// address."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0]
    return host.startswith(LOOPBACK)


def warn_if_exposed(address: str, what: str, curve: bool = False) -> None:
    if not curve and not is_local(address):
        log.warning("%s binds %s, beyond this machine, without CURVE: any host that reaches it can send messages. "
                    "Bind 127.0.0.1, or turn on --curve-keys", what, address)
