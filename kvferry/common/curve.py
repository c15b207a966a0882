"""CurveZMQ: encryption and authentication for every socket, turned on with --curve-keys DIR.

`kvferry keys DIR` writes two key pairs: the servers' (the gateway's control socket, a decode worker's
KV ingress) and the clients' (workers connecting to those). Every process is given the same folder.
A server takes only clients that present a public key found in DIR/clients/: a peer without the
client key can neither register nor send a message, and nobody on the wire can read the traffic.
Give a folder only to the processes of one deployment (in Kubernetes: a Secret).
"""

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvferry.common.errors import ConfigError

log = logging.getLogger("kvferry.curve")
SERVER, CLIENT = "server", "client"


def generate(folder: str | Path) -> list[Path]:
    """Write both key pairs (and the clients' public key where servers look for it); returns the files."""
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    clients = folder / "clients"
    clients.mkdir(exist_ok=True)
    for name in (SERVER, CLIENT):
        for suffix in (".key", ".key_secret"):
            (folder / f"{name}{suffix}").unlink(missing_ok=True)
        zmq.auth.create_certificates(folder, name)
    shutil.copy(folder / f"{CLIENT}.key", clients / f"{CLIENT}.key")
    for secret in folder.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    return sorted(p for p in folder.rglob("*") if p.is_file())


@dataclass(frozen=True)
class CurveKeys:
    folder: Path
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def load(cls, folder: str | Path | None) -> "CurveKeys | None":
        if not folder:
            return None
        folder = Path(folder)
        try:
            server_public, server_secret = zmq.auth.load_certificate(folder / f"{SERVER}.key_secret")
            client_public, client_secret = zmq.auth.load_certificate(folder / f"{CLIENT}.key_secret")
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"--curve-keys {folder}: cannot read the keys ({exc}); create them with `kvferry keys {folder}`"
            ) from None
        if not (folder / "clients").is_dir():
            raise ConfigError(f"--curve-keys {folder}: no clients/ folder; create the keys with `kvferry keys`")
        return cls(folder, server_public, server_secret, client_public, client_secret)

    def serve(self, sock: zmq.Socket) -> None:
        """Before bind: this socket accepts only CURVE clients."""
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = self.server_secret, self.server_public, True

    def connect(self, sock: zmq.Socket) -> None:
        """Before connect: this socket speaks CURVE to a server with our server key."""
        sock.curve_secretkey, sock.curve_publickey = self.client_secret, self.client_public
        sock.curve_serverkey = self.server_public

    def authenticator(self, ctx: zmq.Context) -> ThreadAuthenticator:
        """Started on the context of the serving sockets, before they bind: it admits only the public keys in
        clients/. It runs in a thread of its own, so it also serves an asyncio context (through a plain shadow
        of the same libzmq context)."""
        auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=logging.getLogger("kvferry.curve.zap"))
        auth.start()
        auth.configure_curve(domain="*", location=str(self.folder / "clients"))
        return auth
