"""CurveZMQ: encryption and authentication for every ZeroMQ socket, turned on with --curve-keys DIR.

docs/operations.md ("CURVE, with a key per role") has the key folder's layout, what `kvferry keys` writes and which
process needs which files. The gateway's control socket admits the client keys in DIR/clients/ (prefill and decode
workers), each decode worker's KV ingress those in DIR/kv-clients/ (prefill workers only: a decode key cannot send
KV). An admitted key file records its role (`role = "prefill"` under its metadata; without it, prefill.key and
decode.key are that role's). The authenticator names each admitted peer "ROLE:NAME" (the ZAP User-Id, which ZeroMQ
hands the server with each message), and the gateway lets a key register only as its role, and only the key that
registered a worker id speak for it (services/gateway/server.py).

It fails closed: a serving socket enforces a ZAP domain, so with no authenticator it refuses every client, and a
secret key file that every user may read is refused at start. A failed handshake is logged on both sides, saying
what to fix.
"""

import itertools
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvferry.common import settings
from kvferry.common.errors import ConfigError

log = logging.getLogger("kvferry.curve")
SERVER = "server"
CLIENTS, KV_CLIENTS = "clients", "kv-clients"
ADMITTED_IN = {"prefill": (CLIENTS, KV_CLIENTS), "decode": (CLIENTS,)}  # where each role's client key is admitted
ADMITS = {"gateway": CLIENTS, "prefill": None, "decode": KV_CLIENTS}  # whose keys each role's serving socket admits
ZAP_DOMAIN = b"kvferry"
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
ROLE_LINE = re.compile(r'\s*role\s*=\s*"([^"]*)"\s*')  # under a key file's metadata: the role it is admitted as
LOG_EVERY_S = 60.0  # a peer that retries every 100 ms is logged at once, then once a minute


def _label() -> str:
    return settings.label("curve_keys")


def _need_curve() -> None:
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support")


# -- key files ------------------------------------------------------------------------------------------------------
class KeyHolder(NamedTuple):
    """Whom an admitted client key belongs to: the role it was admitted as (None: its file records none) and its
    file's name."""

    role: str | None
    name: str

    @property
    def user_id(self) -> str:
        """As the ZAP handler answers it, and ZeroMQ hands it on with each message: "ROLE:NAME"."""
        return f"{self.role or ''}:{self.name}"

    @classmethod
    def of(cls, frame: zmq.Frame) -> "KeyHolder":
        """The holder of the key a received frame (one received with copy=False) came in under. Only on a socket
        that serves CURVE: ZeroMQ knows no User-Id otherwise."""
        role, _, name = frame.get("User-Id").partition(":")
        return cls(role or None, name)


def _write_key(path: Path, public: bytes, secret: bytes | None = None, role: str | None = None) -> Path:
    """A new key file in the format zmq.auth reads, with the role it is admitted as. A secret one is 0600 from the
    moment it exists (O_EXCL with the mode: no window where another user could read it, and nothing is ever
    overwritten)."""
    kind = "Secret" if secret else "Public"
    lines = [f"#   ZeroMQ CURVE {kind} Certificate, written by `kvferry keys`", "", "metadata"]
    if role:
        lines.append(f'    role = "{role}"')
    lines.append("curve")
    lines.append(f'    public-key = "{public.decode()}"')
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _write_pair(folder: Path, name: str, role: str | None = None) -> tuple[bytes, list[Path]]:
    public, secret = zmq.curve_keypair()
    return public, [
        _write_key(folder / f"{name}.key", public, role=role),
        _write_key(folder / f"{name}.key_secret", public, secret, role),
    ]


def generate(folder: str | Path) -> list[Path]:
    """A new deployment's keys (the layout above); returns the files. A folder that holds keys already is refused:
    overwriting them would lock every running process out."""
    _need_curve()
    folder = Path(folder)
    if (folder / f"{SERVER}.key").exists() or (folder / f"{SERVER}.key_secret").exists():
        raise ConfigError(
            f"{folder} holds a deployment's keys already: give one worker a pair of its own with "
            f"`kvferry keys {folder} --client NAME --role ROLE`, or write new keys into an empty folder"
        )
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _, written = _write_pair(folder, SERVER)
    for role in ADMITTED_IN:
        written += add_client(folder, role, role)
    return written


def add_client(folder: str | Path, name: str, role: str) -> list[Path]:
    """A client pair of its own for one worker of `role`, its public key admitted where that role is admitted."""
    folder = Path(folder)
    if role not in ADMITTED_IN:
        raise ConfigError(f"--role {role!r}: a client key is for a prefill or a decode worker")
    _check_name(name)
    if not (folder / f"{SERVER}.key").is_file():
        raise ConfigError(f"{folder} holds no deployment's keys (server.key): write them first with `kvferry keys DIR`")
    targets = [folder / f"{name}.key", folder / f"{name}.key_secret"]
    targets += [folder / admitted / f"{name}.key" for admitted in ADMITTED_IN[role]]
    if any(path.exists() for path in targets):
        raise ConfigError(f"{folder} has a key named {name!r} already: choose another name, or --revoke {name} first")
    public, written = _write_pair(folder, name, role)
    for admitted in ADMITTED_IN[role]:
        (folder / admitted).mkdir(exist_ok=True)
        written.append(_write_key(folder / admitted / f"{name}.key", public, role=role))
    return written


def revoke(folder: str | Path, name: str) -> list[Path]:
    """Take a client key out of every admitted folder (and its pair out of the folder); returns what was removed.
    Servers read the admitted keys as they start: restart them, and from then on they refuse it."""
    folder = Path(folder)
    _check_name(name, "--revoke")
    found = [folder / sub / f"{name}.key" for sub in (CLIENTS, KV_CLIENTS)]
    found = [path for path in (*found, folder / f"{name}.key", folder / f"{name}.key_secret") if path.exists()]
    if not found:
        raise ConfigError(f"no client key named {name!r} in {folder}")
    for path in found:
        path.unlink()
    return found


def _check_name(name: str, setting: str = "--client") -> None:
    if not KEY_NAME.fullmatch(name) or name == SERVER:
        raise ConfigError(
            f"{setting}: {name!r} cannot name a client key: use letters, digits, '.', '_' and '-', not 'server'"
        )


def _read_public(path: Path) -> bytes:
    try:
        return zmq.auth.load_certificate(path)[0]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{_label()}: cannot read {path} ({exc}); write the keys with `kvferry keys DIR`") from None


def _read_secret(path: Path, fix: str) -> tuple[bytes, bytes]:
    """A key pair, from a file that not every user may read (0440 passes: a Kubernetes Secret with fsGroup)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{_label()}: cannot read {path} ({exc}); {fix}") from None
    if mode & 0o004:
        raise ConfigError(
            f"{_label()}: {path} is readable by every user (mode {mode:04o}), and it holds a secret key: "
            f"chmod 600 {path} (or 640 or 440, to share it with a group)"
        )
    if not secret:
        raise ConfigError(f"{_label()}: {path} holds no secret key; {fix}")
    return public, secret


def _read_role(path: Path) -> str | None:
    """The role an admitted key file records; for a file written before keys recorded one, the role its name
    implies (prefill.key, decode.key), else None: such a key registers as no worker."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        raise ConfigError(f"{_label()}: cannot read {path} ({exc})") from None
    roles = [match.group(1) for match in map(ROLE_LINE.fullmatch, lines) if match]
    role = roles[0] if roles else path.stem if path.stem in ADMITTED_IN else None
    if role is None:
        log.warning(
            '%s records no role, so its holder can register as no worker: add the line `    role = "prefill"` (or '
            '"decode") under its metadata, or re-admit it with `kvferry keys DIR --revoke %s` then `--client %s '
            "--role ROLE`",
            path,
            path.stem,
            path.stem,
        )
    elif role not in ADMITTED_IN:
        raise ConfigError(f'{_label()}: {path} records the role "{role}": a client key is a prefill or a decode one')
    return role


def _read_admitted(folder: Path) -> dict[bytes, KeyHolder]:
    """The client public keys in folder, as key -> whose it is (the file's name, which logs show, and its role)."""
    if not folder.is_dir():
        raise ConfigError(
            f"{_label()}: no {folder.name}/ folder in {folder.parent}: it lists the client keys this process "
            "admits; write the keys with `kvferry keys DIR`"
        )
    admitted = {_read_public(path): KeyHolder(_read_role(path), path.stem) for path in sorted(folder.glob("*.key"))}
    if not admitted:
        log.warning("%s holds no client keys: every client will be refused", folder)
    return admitted


# -- the keys of one process ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CurveKeys:
    folder: Path
    server_public: bytes
    server_secret: bytes | None = None  # the processes that serve: the gateway, decode workers
    client_name: str | None = None  # workers: the pair they present
    client_public: bytes | None = None
    client_secret: bytes | None = None
    admits: str | None = None  # the subfolder of client keys our serving sockets admit
    admitted: dict[bytes, KeyHolder] = field(default_factory=dict, hash=False)  # public key -> whose it is

    @classmethod
    def load(cls, folder: str | Path | None, client: str | None = None, admits: str | None = CLIENTS):
        """The keys in folder that one process needs (None without a folder): client, the pair a worker presents;
        admits, the subfolder of client keys its serving sockets admit (None for a process that only connects).
        The defaults are the gateway's."""
        if not folder:
            return None
        _need_curve()
        folder = Path(folder)
        if not folder.is_dir():
            raise ConfigError(f"{_label()}: no folder {folder}; write a deployment's keys with `kvferry keys {folder}`")
        keys = {"server_public": _read_public(folder / f"{SERVER}.key")}
        if admits:
            fix = (
                "the processes that serve (the gateway, decode workers) need the server pair that `kvferry keys` wrote"
            )
            _, keys["server_secret"] = _read_secret(folder / f"{SERVER}.key_secret", fix)
            keys["admitted"] = _read_admitted(folder / admits)
        if client:
            _check_name(client, settings.label("curve_client"))
            fix = (
                f"give the worker a client pair of this deployment: {settings.label('curve_client')} names it "
                f"(default: the role), and `kvferry keys DIR --client NAME --role ROLE` writes one"
            )
            keys["client_public"], keys["client_secret"] = _read_secret(folder / f"{client}.key_secret", fix)
        return cls(folder, client_name=client, admits=admits, **keys)

    @classmethod
    def for_role(cls, folder: str | Path | None, role: str, client: str | None = None):
        """The keys a gateway, prefill or decode process loads; a worker presents `client` (default: its role's)."""
        if role == "gateway":
            return cls.load(folder)
        return cls.load(folder, client=client or role, admits=ADMITS[role])

    def serve(self, sock: zmq.Socket) -> None:
        """Before bind: this socket takes only CURVE clients that our authenticator admits, and none without it."""
        if self.server_secret is None:
            raise ConfigError(f"{_label()}: this process has no server key pair, so it cannot serve a CURVE socket")
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = self.server_secret, self.server_public, True
        sock.zap_domain = ZAP_DOMAIN
        sock.zap_enforce_domain = True  # no ZAP handler running: the handshake fails (libzmq would admit anyone)
        watch_handshakes(sock, self._server_side_failure, logging.WARNING)

    def connect(self, sock: zmq.Socket) -> None:
        """Before connect: this socket speaks CURVE to a server with our server key, and logs a failed handshake."""
        if self.client_secret is None:
            raise ConfigError(f"{_label()}: this process has no client key pair, so it cannot connect with CURVE")
        sock.curve_secretkey, sock.curve_publickey = self.client_secret, self.client_public
        sock.curve_serverkey = self.server_public
        watch_handshakes(sock, self._client_side_failure, logging.ERROR)  # this worker cannot work: an error

    def authenticator(self, ctx: zmq.Context) -> ThreadAuthenticator:
        """Started on the context of the serving sockets, before they bind: it admits only the public keys in the
        admitted folder. It runs in a thread of its own, so it also serves an asyncio context (through a plain
        shadow of the same libzmq context)."""
        if self.admits is None:
            raise ConfigError(f"{_label()}: this process admits no clients, so it has no authenticator")
        auth = KeyAuthenticator(zmq.Context.shadow(ctx.underlying), self.admitted, self.folder / self.admits)
        auth.start()
        return auth

    # What each side of a failed handshake logs: one line that says what to fix.
    def _client_side_failure(self, event: int, value: int, endpoint: str) -> str | None:
        key = f"{self.folder}/{self.client_name}.key"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"the server at {endpoint} refused this worker's CURVE key {self.client_name!r} ({key}, "
                f"status {value}): it is not among the keys that server admits (revoked, or never added). Give the worker an admitted "
                f"pair ({settings.label('curve_client')}), or admit this one with `kvferry keys DIR --client NAME "
                f"--role ROLE` and restart the server"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return f"the server at {endpoint} does not speak CURVE: give it {_label()} too"
        return (
            f"this worker failed the CURVE handshake with the server at {endpoint} ({_event_name(event, value)}): "
            f"most likely {self.folder}/server.key is not that server's key. Give every process keys from one "
            f"`kvferry keys` folder ({_label()})"
        )

    def _server_side_failure(self, event: int, value: int, endpoint: str) -> str | None:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return None  # the authenticator logs it, with the peer's address and key
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return f"refused a peer without CURVE on {endpoint}: a worker of this deployment needs {_label()} too"
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return f"refused a peer on {endpoint} whose CURVE handshake does not decrypt: it has another server.key"
        return f"a peer failed the CURVE handshake on {endpoint} ({_event_name(event, value)}), and was refused"


class KeyAuthenticator(ThreadAuthenticator):
    """ZAP: admits a CURVE client whose public key is in `admitted`, on our ZAP domain only, as its holder's User-Id
    ("ROLE:NAME"), and logs each refusal with the peer's address and key."""

    def __init__(self, ctx: zmq.Context, admitted: dict[bytes, KeyHolder], where: Path):
        super().__init__(ctx, log=logging.getLogger("kvferry.curve.zap"))
        self.admitted, self.where, self.throttle = admitted, where, Throttle()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) < 6:
            if len(msg) >= 2:
                self._answer(msg[1], None)
            return
        version, request_id, domain, address, _identity, mechanism, *credentials = msg
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and len(credentials) == 1 else b""
        holder = self.admitted.get(key) if version == b"1.0" and domain == ZAP_DOMAIN else None
        peer = address.decode(errors="replace")
        if holder is None:
            held = self.throttle((peer, key))
            if held is not None:
                log.warning(
                    "refused a client at %s: its CURVE key %s is not admitted here (not in %s: revoked, or another "
                    "deployment's)%s",
                    peer,
                    key.decode() or f"(none: {mechanism.decode(errors='replace')})",
                    self.where,
                    f"; {held} more refusals since the last line" if held else "",
                )
        else:
            log.debug("admitted %s at %s", holder.user_id, peer)
        self._answer(request_id, holder)

    def _answer(self, request_id: bytes, holder: KeyHolder | None) -> None:
        status = [b"200", b"OK", holder.user_id.encode()] if holder else [b"400", b"key not admitted", b""]
        self.zap_socket.send_multipart([b"1.0", request_id, *status, b""])


# -- failed handshakes --------------------------------------------------------------------------------------------
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_monitors = itertools.count()


class Throttle:
    """The first line of each kind at once, then at most one every LOG_EVERY_S, saying how many were held back.
    Thread-safe: the monitors of all a process's sockets share one."""

    def __init__(self, every_s: float = LOG_EVERY_S, most_kinds: int = 1000):
        self.every_s, self.most_kinds = every_s, most_kinds
        self.seen: dict[object, tuple[float, int]] = {}  # kind -> (logged at, held back since)
        self.lock = threading.Lock()

    def __call__(self, kind) -> int | None:
        """None: hold this one back; else log it, with the count held back before it."""
        now = time.monotonic()
        with self.lock:
            logged_at, held = self.seen.get(kind, (None, 0))
            if logged_at is not None and now - logged_at < self.every_s:
                self.seen[kind] = (logged_at, held + 1)
                return None
            if len(self.seen) >= self.most_kinds:  # a peer that varies its key must not grow this without bound
                self.seen.clear()
            self.seen[kind] = (now, 0)
            return held


_handshake_lines = Throttle()  # a worker's sockets to one server fail alike: one line for them all


def watch_handshakes(sock: zmq.Socket, describe, level: int) -> None:
    """Log each failed handshake of sock at level, as describe(event, value, endpoint) words it (None: not logged),
    from a thread that reads the socket's monitor and ends when the socket closes. Called by the socket's own
    thread."""
    address = f"inproc://kvferry.curve.monitor.{os.getpid()}.{next(_monitors)}"
    sock.monitor(address, HANDSHAKE_FAILURES | zmq.EVENT_MONITOR_STOPPED)
    events = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)  # a plain socket, whatever sock's kind
    events.linger = 0
    events.connect(address)
    threading.Thread(target=_log_handshakes, args=(events, describe, level), name="curve-monitor", daemon=True).start()


def _log_handshakes(events: zmq.Socket, describe, level: int) -> None:
    try:
        while True:
            message = recv_monitor_message(events)
            event, value, endpoint = message["event"], int(message["value"]), message["endpoint"].decode()
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            line = describe(event, value, endpoint)
            held = _handshake_lines(line) if line else None
            if held is not None:
                log.log(level, "%s%s", line, f" ({held} more since the last line)" if held else "")
    except zmq.ContextTerminated:
        pass
    finally:
        events.close(0)


def _event_name(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        try:
            return f"protocol error {zmq.Event(value).name}"
        except ValueError:
            return f"protocol error {value:#x}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return f"connection closed: {os.strerror(value)}" if value else "no detail"
    return zmq.Event(event).name
