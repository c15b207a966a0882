"""CURVE keys and the bind check, on real files and real sockets: `kvferry keys` (modes, per-worker keys, revocation),
loading (a world-readable secret refused), who admits whom (a decode key cannot reach a KV ingress), failing closed
(no authenticator: nobody gets in), both sides of a failed handshake in the logs, and a bind beyond loopback."""

import logging
import os
import stat
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvferry.common.bind_check import check_exposed, is_local
from kvferry.common.curve import KV_CLIENTS, CurveKeys, KeyHolder, generate
from kvferry.common.errors import ConfigError
from kvferry.tools.cli import main as kvferry

DEPLOYMENT = {
    "server.key",
    "server.key_secret",
    "prefill.key",
    "prefill.key_secret",
    "decode.key",
    "decode.key_secret",
    "clients/prefill.key",
    "clients/decode.key",
    "kv-clients/prefill.key",
}


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_kvferry_keys_writes_a_pair_per_role_with_secrets_0600(tmp_path, capsys):
    old_umask = os.umask(0)  # the mode comes from the code, not from a strict umask
    try:
        assert kvferry(["keys", str(tmp_path / "k")]) == 0
    finally:
        os.umask(old_umask)
    folder = tmp_path / "k"
    assert files(folder) == DEPLOYMENT
    assert {Path(line).relative_to(folder).as_posix() for line in capsys.readouterr().out.split()} == DEPLOYMENT
    for path in folder.rglob("*.key_secret"):
        assert mode(path) == 0o600, path
    for path in folder.rglob("*.key"):
        assert mode(path) & 0o022 == 0, path  # public, but nobody else may change whom we trust
    # A second run would overwrite a deployment's keys: refused, naming what to do instead.
    assert kvferry(["keys", str(folder)]) == 2
    assert "--client NAME" in capsys.readouterr().err
    assert files(folder) == DEPLOYMENT


def test_a_worker_gets_a_key_of_its_own_and_loses_it_alone(tmp_path, capsys):
    folder = tmp_path / "k"
    generate(folder)
    assert kvferry(["keys", str(folder), "--client", "prefill-7", "--role", "prefill"]) == 0
    assert kvferry(["keys", str(folder), "--client", "decode-3", "--role", "decode"]) == 0
    added = {"prefill-7.key", "prefill-7.key_secret", "clients/prefill-7.key", "kv-clients/prefill-7.key"}
    added |= {"decode-3.key", "decode-3.key_secret", "clients/decode-3.key"}  # a decode key never sends KV
    assert files(folder) == DEPLOYMENT | added
    assert mode(folder / "prefill-7.key_secret") == 0o600
    keys = CurveKeys.load(folder, client="prefill-7", admits=None)
    assert keys.client_public == zmq.auth.load_certificate(folder / "clients" / "prefill-7.key")[0]
    # Each admitted copy records the role it is admitted as: the gateway binds registrations to it.
    assert CurveKeys.load(folder).admitted[keys.client_public] == KeyHolder("prefill", "prefill-7")
    assert set(CurveKeys.load(folder, client="decode", admits=KV_CLIENTS).admitted.values()) == {
        KeyHolder("prefill", "prefill"),
        KeyHolder("prefill", "prefill-7"),
    }
    for bad in (
        ["--client", "prefill-7", "--role", "prefill"],
        ["--client", "x/y", "--role", "decode"],
        ["--client", "z"],
    ):
        capsys.readouterr()
        assert kvferry(["keys", str(folder), *bad]) == 2, bad
        assert "kvferry: error:" in capsys.readouterr().err
    assert kvferry(["keys", str(folder), "--revoke", "prefill-7"]) == 0
    assert files(folder) == DEPLOYMENT | added - {p for p in added if "prefill-7" in p}
    assert kvferry(["keys", str(folder), "--revoke", "prefill-7"]) == 2
    assert kvferry(["keys", str(tmp_path / "empty"), "--client", "a", "--role", "prefill"]) == 2


def test_keys_admitted_before_they_recorded_a_role_keep_the_role_their_name_implies(tmp_path, caplog):
    """Key files written before roles were recorded: prefill.key and decode.key are those roles'; a worker's own key
    with no role is admitted, but as no role (it may register as no worker), and the log says how to fix it."""
    folder = tmp_path / "k"
    generate(folder)
    clients = folder / "clients"
    for path in clients.glob("*.key"):
        path.write_text("\n".join(line for line in path.read_text().splitlines() if "role =" not in line) + "\n")
    old = zmq.auth.load_certificate(clients / "decode.key")[0]
    (clients / "worker-9.key").write_text((clients / "decode.key").read_text().replace(old.decode(), "x" * 40))
    with caplog.at_level(logging.WARNING, logger="kvferry.curve"):
        admitted = CurveKeys.load(folder).admitted
    assert set(admitted.values()) == {
        KeyHolder("prefill", "prefill"),
        KeyHolder("decode", "decode"),
        KeyHolder(None, "worker-9"),
    }
    [warning] = [r.getMessage() for r in caplog.records if "records no role" in r.getMessage()]
    assert "worker-9.key" in warning and "--revoke worker-9" in warning
    (clients / "worker-9.key").write_text(
        (clients / "worker-9.key").read_text().replace("metadata", 'metadata\n    role = "gateway"')
    )
    with pytest.raises(ConfigError, match='worker-9.key records the role "gateway"'):
        CurveKeys.load(folder)


def test_a_secret_key_readable_by_every_user_is_refused(tmp_path):
    folder = tmp_path / "k"
    generate(folder)
    secret = folder / "decode.key_secret"
    for readable in (0o644, 0o604):
        secret.chmod(readable)
        with pytest.raises(ConfigError, match=f"chmod 600 {secret}"):
            CurveKeys.load(folder, client="decode", admits=KV_CLIENTS)
    for fine in (0o440, 0o640, 0o400):  # a Kubernetes Secret mounted with defaultMode 0440 and the pod's fsGroup
        secret.chmod(fine)
        assert CurveKeys.load(folder, client="decode", admits=KV_CLIENTS).client_secret
    (folder / "server.key_secret").chmod(0o644)
    with pytest.raises(ConfigError, match="readable by every user"):
        CurveKeys.load(folder)
    assert CurveKeys.load(folder, client="prefill", admits=None)  # a prefill worker never reads the server secret


def test_each_process_needs_only_its_own_files(tmp_path):
    folder = tmp_path / "k"
    generate(folder)
    gateway = CurveKeys.load(folder)  # the gateway: the server pair, and clients/
    assert gateway.server_secret and gateway.client_secret is None
    assert set(gateway.admitted.values()) == {KeyHolder("prefill", "prefill"), KeyHolder("decode", "decode")}
    decode = CurveKeys.load(folder, client="decode", admits=KV_CLIENTS)
    assert set(decode.admitted.values()) == {KeyHolder("prefill", "prefill")}
    for missing, role in (
        ("server.key", {}),
        ("clients", {}),
        ("kv-clients", {"client": "decode", "admits": KV_CLIENTS}),
    ):
        copy = tmp_path / f"without-{missing}"
        generate(copy)
        target = copy / missing
        if target.is_dir():
            for p in target.iterdir():
                p.unlink()
            target.rmdir()
        else:
            target.unlink()
        with pytest.raises(ConfigError, match="--curve-keys"):
            CurveKeys.load(copy, **role)
    with pytest.raises(ConfigError, match="kvferry keys"):
        CurveKeys.load(tmp_path / "missing")
    with pytest.raises(ConfigError, match="curve-client"):
        CurveKeys.load(folder, client="nobody", admits=None)
    assert CurveKeys.load(None) is None


# -- sockets ------------------------------------------------------------------------------------------------------
def reaches(server: CurveKeys, client: CurveKeys, authenticate: bool = True, wait_s: float = 2.0) -> bool:
    """Whether one message from a CURVE client with `client`'s keys reaches a server with `server`'s keys, on a
    fresh context (the ZAP handler is one per context)."""
    ctx = zmq.Context()
    auth = server.authenticator(ctx) if authenticate else None
    receiver, sender = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        server.serve(receiver)
        port = receiver.bind_to_random_port("tcp://127.0.0.1")
        client.connect(sender)
        sender.connect(f"tcp://127.0.0.1:{port}")
        sender.send(b"hello")
        got = receiver.poll(int(wait_s * 1000))
        assert not got or receiver.recv_multipart()[1] == b"hello"
        assert receiver.curve_server and receiver.zap_enforce_domain
        return bool(got)
    finally:
        receiver.close(0), sender.close(0)
        if auth:
            auth.stop()
        ctx.term()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("curve") / "keys"
    generate(folder)
    return folder


def test_the_gateway_admits_both_roles_and_a_kv_ingress_prefill_keys_only(deployment, caplog):
    gateway = CurveKeys.load(deployment)
    kv_ingress = CurveKeys.load(deployment, client="decode", admits=KV_CLIENTS)
    prefill = CurveKeys.load(deployment, client="prefill", admits=None)
    decode = CurveKeys.load(deployment, client="decode", admits=KV_CLIENTS)
    assert reaches(gateway, prefill) and reaches(gateway, decode)
    assert reaches(kv_ingress, prefill)
    with caplog.at_level(logging.INFO, logger="kvferry.curve"):
        assert not reaches(kv_ingress, decode, wait_s=1.0), "a decode key must not send KV"
        wait_for(lambda: "not admitted" in caplog.text and "refused this worker's CURVE key" in caplog.text)
    [server_side] = [r.getMessage() for r in caplog.records if "not admitted" in r.getMessage()]
    assert decode.client_public.decode() in server_side and "127.0.0.1" in server_side and "kv-clients" in server_side
    [client_side] = [r for r in caplog.records if "refused this worker's CURVE key" in r.getMessage()]
    assert client_side.levelno == logging.ERROR and "--curve-client" in client_side.getMessage()


def test_without_a_running_authenticator_nobody_gets_in(deployment):
    gateway, prefill = CurveKeys.load(deployment), CurveKeys.load(deployment, client="prefill", admits=None)
    assert reaches(gateway, prefill)
    assert not reaches(gateway, prefill, authenticate=False, wait_s=1.0)


def test_a_client_with_another_deployments_server_key_says_what_to_fix(deployment, tmp_path, caplog):
    other = tmp_path / "other"
    generate(other)
    gateway = CurveKeys.load(deployment)
    stranger = CurveKeys.load(other, client="prefill", admits=None)
    with caplog.at_level(logging.INFO, logger="kvferry.curve"):
        assert not reaches(gateway, stranger, wait_s=1.0)
        wait_for(lambda: "server.key" in caplog.text and "failed the CURVE handshake" in caplog.text)
    client_side = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"{other}/server.key" in line for line in client_side), client_side


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- binding beyond loopback --------------------------------------------------------------------------------------
def test_a_zeromq_bind_beyond_loopback_needs_curve_or_insecure(caplog):
    for local in ("tcp://127.0.0.1:0", "tcp://127.0.0.2:5557", "tcp://[::1]:5557", "tcp://localhost:1", "ipc:///tmp/x"):
        assert is_local(local), local
        check_exposed(local, "the socket")
    for exposed in (
        "tcp://0.0.0.0:5557",
        "tcp://*:5557",
        "tcp://10.1.2.3:1",
        "tcp://127.evil.example:1",
        "ws://0.0.0.0:1",
    ):
        assert not is_local(exposed), exposed
        with pytest.raises(ConfigError) as refused:
            check_exposed(exposed, "the gateway's control socket")
        message = str(refused.value)
        assert "\n" not in message and exposed in message
        for fix in ("--curve-keys", "kvferry keys", "--insecure"):
            assert fix in message, (fix, message)
        check_exposed(exposed, "the gateway's control socket", curve=True)
        with caplog.at_level(logging.WARNING, logger="kvferry.transport"):
            check_exposed(exposed, "the gateway's control socket", insecure=True)
        assert "--insecure" in caplog.records[-1].getMessage() and caplog.records[-1].levelno == logging.WARNING
