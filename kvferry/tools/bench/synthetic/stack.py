"""The real gateway (`kvferry gateway`, a process of its own, or `--gateways N` of them on one port) serving the
synthetic model, and a synthetic prefill and decode worker beside it, registered with every gateway, on free 127.0.0.1
ports: for `kvferry bench gateway` and the tests. Each process may be pinned to a set of CPUs from its start, so that
every thread it starts later is pinned too (a group's gateway processes take their supervisor's CPUs)."""

import contextlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.common import settings
from kvferry.common.errors import KvferryError
from kvferry.common.gateway_ports import control_addresses
from kvferry.services.launcher import child_setup, free_port, stop_all, wait_until
from kvferry.tools.bench.synthetic.send_counts import read_send_counts

READY_TIMEOUT_S = 60.0
# The caller's settings the stack keeps: where the default model's files are, and the block size (the gateway and
# the doubles read it alike). Any other (an API key, tracing, a served name) would change what is measured.
KEPT_SETTINGS = tuple(settings.env_name(name) for name in ("cache_dir", "block_size"))


@dataclass
class SyntheticStack:
    url: str
    port: int
    control: str  # every gateway's control address, comma-separated (as the doubles take them)
    gateway: subprocess.Popen  # the gateway; with several, their supervisor (it serves nothing itself)
    prefill: subprocess.Popen
    decode: subprocess.Popen
    log_dir: Path
    gateways: dict[str, int] = field(default_factory=dict)  # each gateway process's id -> its pid, in index order

    def send_counts(self) -> dict[str, dict[str, int]]:
        """Each double's send counts so far (send_counts.py), by role."""
        return {role: read_send_counts(self.log_dir / f"{role}.counts") for role in ("prefill", "decode")}

    def logs(self) -> str:
        """Each process's last lines, for an error that needs them."""
        return "\n".join(
            f"--- {name}.log:\n" + "\n".join((self.log_dir / f"{name}.log").read_text().splitlines()[-15:])
            for name in ("gateway", "prefill", "decode")
        )


def start(name: str, command: list[str], log_dir: Path, cpus: set[int] | None, env: dict) -> subprocess.Popen:
    """A process of the stack, on cpus, logging to log_dir/name.log. It gets a SIGTERM when this process dies
    (launcher.child_setup), so that a bench killed outright (a test's timeout) leaves no gateway or double behind."""
    setup = child_setup(os.getpid(), cpus=cpus)
    with open(log_dir / f"{name}.log", "w") as log:
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=setup, start_new_session=True
        )


def double_command(role: str, control: str, folder: Path, *extra: str) -> list[str]:
    module = "kvferry.tools.bench.synthetic"
    return [sys.executable, "-m", module, role, "--gateway", control, "--model-folder", str(folder), *extra]


@contextlib.contextmanager
def synthetic_stack(
    folder: Path,
    log_dir: Path,
    gateway_cpus: set[int] | None = None,
    worker_cpus: set[int] | None = None,
    step_interval_s: float = 0.0,
    num_gateways: int = 1,
):
    """Yields a SyntheticStack once every gateway is healthy with both doubles registered; stops them all on exit.
    folder: prepare_model_folder's. num_gateways: more than 1 starts `kvferry gateway --gateways N`, the group,
    which the doubles register with whole. log_dir takes each process's log; several stacks at once need a log_dir
    each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_") or k in KEPT_SETTINGS}
    port = free_port()
    controls = control_addresses(f"tcp://127.0.0.1:{free_port(num_gateways)}", num_gateways)  # as the group's
    gateway = [sys.executable, "-m", "kvferry.services.commands", "gateway", "--model", str(folder)]
    # No admission bound: every stream of the load waits for its first token at once.
    gateway += ["--host", "127.0.0.1", "--port", str(port), "--control", controls[0], "--max-waiting", "0"]
    gateway += ["--gateways", str(num_gateways)]
    procs = [start("gateway", gateway, log_dir, gateway_cpus, env)]
    try:
        control = ",".join(controls)
        prefill = double_command("prefill", control, folder, "--counts-file", str(log_dir / "prefill.counts"))
        procs.append(start("prefill", prefill, log_dir, worker_cpus, env))
        decode = double_command("decode", control, folder, "--counts-file", str(log_dir / "decode.counts"))
        decode += ["--step-interval", str(step_interval_s)]
        procs.append(start("decode", decode, log_dir, worker_cpus, env))
        stack = SyntheticStack(f"http://127.0.0.1:{port}", port, control, *procs, log_dir)
        ready = ReadyGateways()
        if not wait_until(
            stack.url + "/v1/workers", lambda reply: ready.seen(reply) == num_gateways, procs, READY_TIMEOUT_S
        ):
            raise KvferryError(f"the gateways and their synthetic workers did not come up:\n{stack.logs()}")
        stack.gateways = gateway_processes(stack, ready.ids)
        yield stack
    finally:
        stop_all(procs)


class ReadyGateways:
    """The gateways behind the shared port that have answered /v1/workers with both doubles registered: the kernel
    hands each new connection to one of them, so each is seen in some of the tries only."""

    def __init__(self):
        self.ids: set[str] = set()

    def seen(self, reply) -> int:
        answer = json.loads(reply.read())
        if len(answer["workers"]) == 2:
            self.ids.add(answer["gateway"]["id"])
        return len(self.ids)


def gateway_processes(stack: SyntheticStack, ids: set[str]) -> dict[str, int]:
    """Each gateway's id -> its pid. One gateway is the process started; a group's are its supervisor's children,
    each told its --gateway-index, and each logs its id with its place ("gateway gw-..., process I of N")."""
    if len(ids) == 1:
        return {next(iter(ids)): stack.gateway.pid}
    log = (stack.log_dir / "gateway.log").read_text()
    id_of = {int(i) - 1: gid for gid, i in re.findall(r"\(gateway (gw-[0-9a-f]+), process (\d+) of \d+\)", log)}
    pid_of = {}
    for pid in children(stack.gateway.pid):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--gateway-index" in command:
            pid_of[int(command[command.index(b"--gateway-index") + 1])] = pid
    found = {id_of[i]: pid_of[i] for i in sorted(pid_of) if i in id_of}
    if set(found) != ids:
        raise KvferryError(f"the gateway processes ({pid_of}) and their ids ({id_of}) do not match:\n{stack.logs()}")
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is pid."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # it ended as we looked
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found
