"""--gateways 2: two gateway processes behind one HTTP port, each with its own control port, every worker registered
with both, on real processes over real HTTP, with CURVE and an API key on. Fresh connections reach both processes
(each /v1/workers and /metrics answer says whose it is), requests through the one port are served by both, and
SIGTERM to the process that started them stops every one. The serve stack is shared by this module's tests
(ServeGroup)."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvferry.services.launcher import free_port
from kvferry.tools.bench.synthetic.model_folder import prepare_model_folder
from kvferry.tools.bench.synthetic.stack import double_command
from tests.e2e.stack import Stack
from tests.e2e.test_open_gateway import refusal
from tests.e2e.test_procfile import descendants, running
from tests.tiny_models import save_tiny_chat_model

KEY = "gateways-key"
BODY = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
NUM_TRIES = 60  # fresh connections before both processes must have answered: each misses one with p = 1/2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("model") / "tiny-chat"
    save_tiny_chat_model(folder)
    return str(folder)


class ServeGroup:
    """`kvferry serve --gateways 2`, shared by this module's tests: started at the first test that asks for it, and
    again for any test that comes after the one that stops it. That one is last in the file and pytest keeps the
    file's order, so a plain run starts it once; under pytest-xdist each worker starts its own, and a test handed
    to a worker after that one there still finds it running."""

    def __init__(self, folder: Path, model: str):
        keys = folder / "keys"
        done = subprocess.run(
            [sys.executable, "-m", "kvferry.tools.cli", "keys", str(keys)],
            capture_output=True,
        )
        assert done.returncode == 0, done.stderr
        extra_env = {"KVFERRY_CURVE_KEYS": str(keys), "KVFERRY_API_KEY": KEY}
        self.stack = Stack(folder, model=model, kv_cache_memory="16MiB", extra_env=extra_env)
        self.stack.control_port = free_control_ports()

    def running(self) -> Stack:
        """The stack, ready (serve says so once every worker is registered with each gateway)."""
        stack = self.stack
        stack.auth = {"authorization": f"Bearer {KEY}"}  # a test may have taken it off
        if "serve" not in stack.procs or stack.procs["serve"].poll() is not None:
            stack.start(
                "serve",
                "serve",
                *(
                    "--gateways",
                    "2",
                    "--port",
                    str(stack.port),
                    "--control-port",
                    str(stack.control_port),
                ),
                *("--prefill-threads", "1", "--decode-threads", "1"),
            )
            wait_for_line(stack, "serve", "kvferry: serving on", 240)
        return stack


@pytest.fixture(scope="module")
def serve_group(tmp_path_factory, tiny):
    group = ServeGroup(tmp_path_factory.mktemp("serve"), tiny)
    try:
        yield group
    finally:
        group.stack.close()


@pytest.fixture
def served(serve_group) -> Stack:
    return serve_group.running()


def free_control_ports() -> int:
    return free_port(count=2)


def wait_for_line(stack: Stack, name: str, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in stack.log(name):
        if stack.procs[name].poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{name} never said {text!r}:\n{stack.log(name)[-3000:]}")
        time.sleep(0.2)


def answers_by_gateway(stack: Stack, path: str, parse) -> dict[str, object]:
    """parse(answer) -> (which gateway, what it said), over fresh connections until two gateways have answered."""
    seen: dict[str, object] = {}
    for _ in range(NUM_TRIES):
        gateway_id, said = parse(stack, path)
        seen[gateway_id] = said
        if len(seen) == 2:
            break
    return seen


def workers_answer(stack: Stack, path: str):
    status, answer = stack.get(path)  # urllib: a new connection each time, which the kernel hands to either process
    assert status == 200, answer
    return answer["gateway"]["id"], {w["id"]: w["role"] for w in answer["workers"]}


def metrics_answer(stack: Stack, path: str):
    text = stack.text(path)
    [index] = set(re.findall(r'gateway="([^"]+)"', text))  # every series names the one process that answered
    finished = re.findall(r"^kvferry:request_success_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return index, sum(float(n) for n in finished)


def gateway_processes(serve_pid: int) -> dict[int, list[str]]:
    """The gateway children of serve, as pid -> command line."""
    lines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") for pid in descendants(serve_pid)}
    return {pid: args for pid, args in lines.items() if "gateway" in args}


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_worker_registers_with_both_gateway_processes_which_fresh_connections_reach(
    served,
):
    gateways = gateway_processes(served.procs["serve"].pid)
    controls = {option(args, "--gateway-index"): option(args, "--control") for args in gateways.values()}
    first = served.control_port
    assert controls == {
        "0": f"tcp://127.0.0.1:{first}",
        "1": f"tcp://127.0.0.1:{first + 1}",
    }
    workers = [args for pid in descendants(served.procs["serve"].pid) if "--gateway" in (args := cmdline(pid))]
    assert len(workers) == 2
    assert all(option(args, "--gateway") == f"{controls['0']},{controls['1']}" for args in workers)

    registered = answers_by_gateway(served, "/v1/workers", workers_answer)
    assert len(registered) == 2, f"{NUM_TRIES} fresh connections reached one gateway process only"
    [one, other] = registered.values()
    assert one == other and sorted(one.values()) == ["decode", "prefill"], registered


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_requests_through_the_one_port_are_served_by_both_processes(served):
    def complete(i: int):
        if i % 4 == 0:
            events = served.stream("/v1/completions", BODY, timeout=120)
            assert events[-1] == "[DONE]"
            return events[0]["id"], "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        status, reply = served.post("/v1/completions", BODY, timeout=120)
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
        return reply["id"], reply["choices"][0]["text"]

    num_requests = 32
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(complete, range(num_requests)))
    assert len({rid for rid, _ in replies}) == num_requests  # request ids stay unique across the processes
    assert len({text for _, text in replies}) == 1  # greedy: the same text whichever gateway and worker path

    finished = answers_by_gateway(served, "/metrics", metrics_answer)
    assert len(finished) == 2, f"{NUM_TRIES} scrapes reached one gateway process only"
    assert set(finished) == {
        "0",
        "1",
    }  # labelled by the processes' indexes, the same at every start
    assert sum(finished.values()) == num_requests and all(n > 0 for n in finished.values()), finished
    served.auth = {}
    assert served.post("/v1/completions", BODY)[0] == 401  # each process holds the API key


def test_sigterm_to_serve_stops_every_gateway_and_worker(served):
    """The module's serve stack stops here: ServeGroup starts it again for any test that comes after."""
    serve = served.procs["serve"]
    children = descendants(serve.pid)
    assert len(children) >= 4  # two gateways, two workers
    os.kill(serve.pid, signal.SIGTERM)  # serve alone, not its process group: it must pass the stop on
    assert serve.wait(timeout=60) == 0, served.log("serve")[-3000:]
    deadline = time.monotonic() + 10
    while running(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(children), [cmdline(pid) for pid in running(children)]
    assert "Traceback" not in served.log("serve")


GROUP_TOKENS, STEP_INTERVAL_S = 120, 0.05  # a stream of 6 s: past uvicorn's 5 s for what is left at a plain stop


def test_kvferry_gateway_with_gateways_2_supervises_two_processes_on_one_port(tmp_path):
    """The standalone command, serving the synthetic workers (test doubles): it starts two gateways and logs their
    control addresses for the workers. A SIGTERM to its whole process group (Ctrl-C, `kill -- -PGID`, systemd) reaches
    each gateway twice, directly and passed on: each drains all the same, a stream in flight ends whole, and the
    group exits 0; so does a SIGTERM to it alone, which it passes on. When one gateway dies it stops the other and
    exits 1; when it is killed outright, its gateways stop too."""
    folder = prepare_model_folder(tmp_path)
    stack = Stack(tmp_path)
    first = free_control_ports()
    control = f"tcp://127.0.0.1:{first}"
    both = f"tcp://127.0.0.1:{first},tcp://127.0.0.1:{first + 1}"
    where = ("--port", str(stack.port), "--control", control)
    doubles = [double_command(role, both, folder) for role in ("prefill", "decode")]
    doubles[1] += ["--step-interval", str(STEP_INTERVAL_S)]
    children: dict[int, int] = {}
    try:
        for name, command in zip(("prefill", "decode"), doubles):
            with open(tmp_path / f"{name}.log", "w") as log:
                stack.procs[name] = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        for ending in ("the group gets SIGTERM", "it gets SIGTERM", "a gateway dies", "it is killed"):
            group = stack.start("group", "gateway", "--gateways", "2", "--model", str(folder), *where)
            wait_for_line(stack, "group", f"give each worker --gateway {both}", 60)
            children = descendants(group.pid)
            assert len(gateway_processes(group.pid)) == 2
            if ending == "the group gets SIGTERM":
                stack.wait_for(
                    lambda: both_serve(stack, {"prefill", "decode"}),
                    60,
                    "the doubles at both gateways",
                )
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    first_token = threading.Event()
                    events = pool.submit(stream_chat, stack, GROUP_TOKENS, first_token)
                    assert first_token.wait(60), stack.log("group")[-3000:]
                    os.killpg(group.pid, signal.SIGTERM)  # group.pid leads its own process group (Stack.start)
                    chunks = events.result(timeout=60)
                assert chunks[-1] == "[DONE]", chunks[-3:]  # whole, not cut at the drain's second signal
                assert chunks[-2]["usage"]["completion_tokens"] == GROUP_TOKENS, chunks[-2]
                assert group.wait(timeout=60) == 0, stack.log("group")[-3000:]
            elif ending == "it gets SIGTERM":
                stack.wait_for(lambda: both_serve(stack, set()), 60, "both gateways")
                os.kill(group.pid, signal.SIGTERM)  # it alone: it passes the stop on
                assert group.wait(timeout=60) == 0, stack.log("group")[-3000:]
            elif ending == "a gateway dies":
                stack.wait_for(lambda: both_serve(stack, set()), 60, "both gateways")
                os.kill(next(iter(gateway_processes(group.pid))), signal.SIGKILL)
                assert group.wait(timeout=60) == 1, stack.log("group")[-3000:]
                assert "stopping the others" in stack.log("group")
            else:
                stack.wait_for(lambda: both_serve(stack, set()), 60, "both gateways")
                os.kill(group.pid, signal.SIGKILL)  # no chance to pass anything on: the kernel tells its children
                group.wait(timeout=10)
            deadline = time.monotonic() + 10
            while running(children) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not running(children), f"{ending}: {[cmdline(pid) for pid in running(children)]}"
            stack.procs.pop("group")
    finally:
        stack.close()
        for pid in running(children):  # left by a supervisor killed outright, had they not stopped
            os.kill(pid, signal.SIGKILL)


def both_serve(stack: Stack, roles: set[str]) -> bool:
    """Both gateway processes answer, each with a worker of each of these roles registered."""
    registered = answers_by_gateway(stack, "/v1/workers", workers_answer)
    return len(registered) == 2 and all(roles <= set(workers.values()) for workers in registered.values())


def stream_chat(stack: Stack, max_tokens: int, first_token: threading.Event) -> list:
    """A streamed chat completion's events, each JSON chunk then "[DONE]"; first_token is set at the first chunk."""
    body = {
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        stack.url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=60) as reply:
        for line in reply:
            if line.startswith(b"data: "):
                payload = line[6:].strip().decode()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                first_token.set()
    return events


def test_a_control_port_beyond_loopback_without_curve_is_refused_before_any_gateway_starts():
    env = {k: v for k, v in os.environ.items() if k not in ("KVFERRY_CURVE_KEYS", "KVFERRY_INSECURE")}
    control = f"tcp://0.0.0.0:{free_control_ports()}"
    line = refusal(
        "gateway",
        "--gateways",
        "2",
        "--port",
        str(free_port()),
        "--control",
        control,
        env=env,
    )
    assert f"the gateway's control socket would listen on {control}, beyond this machine, without CURVE" in line
