"""`kvferry serve`: the gateway (or --gateways N of them on one port), one prefill and one decode worker as child
processes of this one."""

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from kvferry.common import settings
from kvferry.common.config import EngineConfig
from kvferry.common.errors import KvferryError
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.gateway_ports import check_gateway_ports, control_addresses
from kvferry.common.memory_budget import most_kv_cache, plan_serve
from kvferry.common.serve_config import ServeConfig
from kvferry.common.setting import from_args

READY_TIMEOUT_S = 300.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Looked up here: a child between fork and exec must not load a library. Elsewhere than Linux, no parent-death signal.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def spawn(*args: str, env: dict, nice: int = 0) -> subprocess.Popen:
    """A child that gets SIGTERM when this process dies, even by SIGKILL, so that it never goes on holding its ports
    (the thread that calls this must live as long as the child: Linux sends it when that thread ends). nice: the
    child's niceness, set before it starts a thread, so every thread it starts inherits it."""
    command = [sys.executable, "-m", "kvferry.services.commands", *args]
    return subprocess.Popen(command, env=env, preexec_fn=child_setup(os.getpid(), nice))


def child_setup(parent: int, nice: int = 0, cpus: set[int] | None = None):
    """What a child of parent (this process's pid) does between fork and exec: ask for SIGTERM when parent dies,
    then take its niceness and its CPUs (cpus: None, any), so that every thread it starts later has them too."""

    def setup() -> None:
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the prctl: its signal will never come
                os._exit(1)
        if nice:
            os.nice(nice)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def wait_until(request, answered, procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Ask request every 0.3 s until answered(reply); False past timeout_s, or once one of procs has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=2) as reply:
            if answered(reply):
                return True
        time.sleep(0.3)
    return False


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # SIGINT may be ignored in a background job; SIGTERM never is
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _interrupt(*_):
    raise KeyboardInterrupt


_handed_out: set[int] = set()


def free_port(count: int = 1) -> int:
    """A port free now and not handed out before by this process, drawn below Linux's ephemeral range (32768 and
    up): a port from bind(0) goes back to the pool outgoing connections draw from, and one could take it first.
    count: the first of that many consecutive such ports (the control ports of --gateways N)."""
    for _ in range(200):
        port = random.randrange(20000, 32768 - count + 1)
        ports = range(port, port + count)
        if _handed_out.intersection(ports) or not all(_is_free(p) for p in ports):
            continue
        _handed_out.update(ports)
        return port
    raise OSError(f"no {count} free consecutive port(s) found in 20000-32767")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def gateway_controls(host: str, port: int, control_port: int, num_gateways: int) -> list[str]:
    """Each gateway's control address on 127.0.0.1, from control_port on; a ConfigError when a port is taken."""
    controls = control_addresses(f"tcp://127.0.0.1:{control_port}", num_gateways, settings.label("control_port"))
    check_gateway_ports(host, port, controls, settings.label("control_port"))
    return controls


def start_services(
    host: str,
    port: int,
    control_port: int,
    prefill_threads: int,
    decode_threads: int,
    env: dict,
    num_prefill: int = 1,
    num_decode: int = 1,
    decode_nice: int = 0,
    prefill_env: dict | None = None,
    num_gateways: int = 1,
) -> list[subprocess.Popen]:
    """The gateways and the workers; returns once they are healthy (stopped again if they fail). num_gateways: gateway
    processes sharing port, on control_port and the ports after it, every worker registered with each."""
    controls = gateway_controls(host, port, control_port, num_gateways)
    control = ",".join(controls)  # as workers take it
    gateway_env = {**env, settings.env_name("gateways"): str(num_gateways)}
    procs = []
    try:
        for index, address in enumerate(controls):
            one_of = ("--gateway-index", str(index)) if num_gateways > 1 else ()
            gateway = ("--host", host, "--port", str(port), "--control", address, *one_of)
            procs.append(spawn("gateway", *gateway, env=gateway_env))
        procs += [
            spawn("prefill", "--gateway", control, "--num-threads", str(prefill_threads), env=prefill_env or env)
            for _ in range(num_prefill)
        ]
        procs += [
            spawn("decode", "--gateway", control, "--num-threads", str(decode_threads), env=env, nice=decode_nice)
            for _ in range(num_decode)
        ]
        url = f"http://{host}:{port}"
        if not wait_until(url + "/health", lambda reply: reply.status == 200, procs, READY_TIMEOUT_S):
            raise KvferryError("the services did not become healthy")
        api_key = env.get(settings.env_name("api_key"))
        workers = urllib.request.Request(
            url + "/v1/workers", headers={"authorization": f"Bearer {api_key}"} if api_key else {}
        )
        num_workers = num_prefill + num_decode
        # Each connection reaches one gateway process, the kernel's pick: asked until each has answered with every
        # worker registered.
        registered: dict[str, int] = {}  # gateway id -> its workers

        def every_worker_at_every_gateway(reply) -> bool:
            answer = json.loads(reply.read())
            registered[answer["gateway"]["id"]] = len(answer["workers"])
            return len(registered) >= num_gateways and min(registered.values()) >= num_workers

        if (num_workers > 2 or num_gateways > 1) and not wait_until(
            workers, every_worker_at_every_gateway, procs, READY_TIMEOUT_S
        ):
            raise KvferryError("not every worker registered with every gateway")
    except BaseException:
        stop_all(procs)
        raise
    return procs


def share_memory(model_dir, engine: EngineConfig) -> tuple[dict[str, str], dict[str, str]]:
    """The memory settings (the prefill worker's, the decode worker's) that let serve's two workers on this host fit
    together (memory_budget.plan_serve): on the CPU each worker's KV cache bytes, given or sized here for both (each
    worker alone would count the same free memory); on a GPU, which they share, each one half of
    --memory-utilization. A ConfigError, before anything starts, where they cannot fit."""
    gpu = engine.device.startswith("cuda") or (engine.device == "auto" and os.path.exists("/dev/nvidiactl"))
    if gpu:
        half = {} if engine.kv_cache_memory is not None else {
            settings.env_name("memory_utilization"): repr(engine.memory_utilization / 2)
        }  # fmt: skip
        return half, half
    weight_bytes = 4 if engine.dtype in ("auto", "float32") else 2  # as loading holds them on the CPU
    kv_bytes = 4 if engine.kv_cache_dtype == "float32" else 2  # auto: half precision on the CPU, whatever the model's
    most = most_kv_cache(model_dir, engine, kv_bytes)
    shared = engine.quantization in ("int8", "int4")  # one worker prepares the host's quantized file, the other maps it
    sizes = plan_serve(model_dir, weight_bytes, engine.kv_cache_memory, engine.memory_utilization, most, shared)
    prefill, decode = ({settings.env_name("kv_cache_memory"): str(size)} for size in sizes)
    return prefill, decode


def serve(args) -> int:
    from kvferry.common.bind_check import check_http_exposed
    from kvferry.common.model_files import resolve_model

    config, gateway = from_args(ServeConfig, args), from_args(GatewayConfig, args)
    # Refused here, before the model and the children: the gateway child would refuse it too, less plainly.
    check_http_exposed(gateway.host, gateway.port, gateway.api_key, args.insecure)
    gateway_controls(gateway.host, gateway.port, config.control_port, gateway.gateways)  # before the model, too
    model_dir = resolve_model(args.model)  # convert once here, not in three processes at the same time
    engine = from_args(EngineConfig, args)
    # Ctrl-C and SIGTERM both stop the children; SIGINT set explicitly: a shell starts background jobs ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    # The children read serve's settings from the environment: each that serve and a child take, as serve got it.
    children = (settings.GATEWAY, settings.PREFILL, settings.DECODE)
    env = settings.apply_environment(dict(os.environ), settings.child_environment(args, settings.SERVE, children))
    prefill_memory, decode_memory = share_memory(model_dir, engine)  # before either starts: they fit, or neither starts
    env.update(decode_memory)
    # The workers share the cores, and an idle OpenMP thread spins 300,000 rounds before it sleeps, taking a core
    # from the other worker. Prefill's spin 10,000: awake across one step's short gaps, no longer. Decode keeps the
    # default: it runs niced, so its spinning yields, and its many short parallel regions run faster with threads
    # awake (docs/benchmarks.md). libgomp reads it as it loads: only the children's environment can carry it.
    prefill_env = {"GOMP_SPINCOUNT": "10000", **env, **prefill_memory}  # a user's spin count wins
    procs = []
    try:
        procs = start_services(
            gateway.host,
            gateway.port,
            config.control_port,
            config.prefill_threads,
            config.decode_threads,
            env,
            decode_nice=config.decode_nice,
            prefill_env=prefill_env,
            num_gateways=gateway.gateways,
        )
        processes = f", {gateway.gateways} gateway processes" if gateway.gateways > 1 else ""
        print(f"kvferry: serving on http://{gateway.host}:{gateway.port}{processes}  (Ctrl-C stops all)", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("kvferry: a service exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all(procs)
