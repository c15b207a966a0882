"""The real gateway (`kvferry gateway`, a process of its own) serving the synthetic model, and a synthetic prefill and
decode worker beside it, on free 127.0.0.1 ports: for `kvferry bench gateway` and the tests. Each process may be
pinned to a set of CPUs from its start, so that every thread it starts later is pinned too."""

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvferry.common import settings
from kvferry.common.errors import KvferryError
from kvferry.services.launcher import free_port, stop_all, wait_until

READY_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True)  # looked up here: a child between fork and exec must not load a library
# The caller's settings the stack keeps: where the default model's files are, and the block size (the gateway and
# the doubles read it alike). Any other (an API key, tracing, a served name) would change what is measured.
KEPT_SETTINGS = tuple(settings.env_name(name) for name in ("cache_dir", "block_size"))


@dataclass
class SyntheticStack:
    url: str
    port: int
    control: str
    gateway: subprocess.Popen
    prefill: subprocess.Popen
    decode: subprocess.Popen
    log_dir: Path

    def logs(self) -> str:
        """Each process's last lines, for an error that needs them."""
        return "\n".join(
            f"--- {name}.log:\n" + "\n".join((self.log_dir / f"{name}.log").read_text().splitlines()[-15:])
            for name in ("gateway", "prefill", "decode")
        )


def child_setup(cpus: set[int] | None):
    """What a child does before it runs: take its CPUs, and ask for a SIGTERM when this process dies, so that a
    bench killed outright (a test's timeout) leaves no gateway or double behind."""

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


def start(name: str, command: list[str], log_dir: Path, cpus: set[int] | None, env: dict) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "w")
    with log:
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=child_setup(cpus), start_new_session=True
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
    gateway_prefix: tuple[str, ...] = (),
):
    """Yields a SyntheticStack once the gateway is healthy with both doubles registered; stops them all on exit.
    folder: prepare_model_folder's. gateway_prefix: a command the gateway runs under (it must exec)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_") or k in KEPT_SETTINGS}
    port, control = free_port(), f"tcp://127.0.0.1:{free_port()}"
    gateway = [*gateway_prefix, sys.executable, "-m", "kvferry.services.commands", "gateway", "--model", str(folder)]
    # No admission bound: every stream of the load waits for its first token at once.
    gateway += ["--host", "127.0.0.1", "--port", str(port), "--control", control, "--max-waiting", "0"]
    procs = [start("gateway", gateway, log_dir, gateway_cpus, env)]
    try:
        procs.append(start("prefill", double_command("prefill", control, folder), log_dir, worker_cpus, env))
        decode = double_command("decode", control, folder, "--step-interval", str(step_interval_s))
        procs.append(start("decode", decode, log_dir, worker_cpus, env))
        stack = SyntheticStack(f"http://127.0.0.1:{port}", port, control, *procs, log_dir)
        if not wait_until(stack.url + "/v1/workers", lambda reply: num_workers(reply) == 2, procs, READY_TIMEOUT_S):
            raise KvferryError(f"the gateway and its synthetic workers did not come up:\n{stack.logs()}")
        yield stack
    finally:
        stop_all(procs)


def num_workers(reply) -> int:
    return len(json.loads(reply.read())["workers"])
