"""Real processes for end-to-end tests: a gateway and workers on free 127.0.0.1 ports, always cleaned up."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvferry.services.launcher import free_port
from tests.tiny_models import save_tiny_chat_model


class Stack:
    def __init__(
        self,
        log_dir: Path,
        model: str | None = None,
        kv_cache_memory: str = "256MiB",
        heartbeat_interval: float = 0.5,
        extra_env: dict | None = None,
    ):
        self.log_dir = log_dir
        self.port, self.control_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.control = f"tcp://127.0.0.1:{self.control_port}"
        self.env = {
            **os.environ,
            "KVFERRY_NUM_THREADS": "1",
            "KVFERRY_KV_CACHE_MEMORY": kv_cache_memory,
            "KVFERRY_HEARTBEAT_INTERVAL": str(heartbeat_interval),
            # Huge pages cost each worker's start about a second of the kernel's compaction, hundreds of starts a
            # run; the in-process tests keep them on.
            "KVFERRY_NO_KV_HUGE_PAGES": "1",
        }
        if model:
            self.env["KVFERRY_MODEL"] = model
        self.env.update(extra_env or {})
        key = self.env.get("KVFERRY_API_KEY")
        self.auth = {"authorization": f"Bearer {key}"} if key else {}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, env: dict | None = None, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """prefix: a command that runs the process (`ip netns exec NS`); it must exec, so that the pid is ours."""
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvferry.tools.cli", *args],
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def start_gateway(self):
        return self.start("gateway", "gateway", "--port", str(self.port), "--control", self.control)

    def start_worker(self, name: str, role: str, *extra: str, env: dict | None = None):
        return self.start(name, role, "--gateway", self.control, "--worker-id", name, *extra, env=env)

    def start_pair(self, prefill: str = "prefill-a", decode: str = "decode-a") -> "Stack":
        """The gateway and one worker of each role, healthy."""
        self.start_gateway()
        self.start_worker(prefill, "prefill")
        self.start_worker(decode, "decode")
        self.wait_for(lambda: self.get("/health")[0] == 200, 180, "healthy stack")
        return self

    def stop(self, name: str, sig=signal.SIGKILL, timeout: float = 30) -> int:
        """Signal the process and wait for it; returns its exit code."""
        proc = self.procs.pop(name)
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout)
        return proc.returncode

    def close(self) -> None:
        for name in list(self.procs):
            try:
                self.stop(name)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    # -- HTTP ------------------------------------------------------------------------------------------------
    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=self.auth), timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def post(self, path: str, body, raw: bytes | None = None, timeout: float = 300) -> tuple[int, dict]:
        status, _, reply = self.exchange(path, body, raw=raw, timeout=timeout)
        return status, reply

    def exchange(
        self, path: str, body, headers: dict | None = None, raw: bytes | None = None, timeout: float = 300
    ) -> tuple[int, dict, dict]:
        """POST and return (status, response headers, JSON body)."""
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"content-type": "application/json", **self.auth, **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())

    def text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def stream(self, path: str, body, timeout: float = 300) -> list:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"content-type": "application/json", **self.auth},
        )
        events = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    payload = line[6:]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events

    def workers(self) -> dict[str, dict]:
        return {w["id"]: w for w in self.get("/v1/workers")[1]["workers"]}

    def wait_for(self, condition, timeout: float = 120, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and name.startswith("gateway"):
                    raise RuntimeError(f"{name} exited:\n{self.log(name)[-3000:]}")
            try:
                if condition():
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}")

    def wait_workers(self, names: set[str], timeout: float = 180) -> None:
        self.wait_for(lambda: names <= set(self.workers()), timeout, f"workers {sorted(names)}")


def tiny_stack(folder: Path, **kwargs) -> Stack:
    """A stack (not started) of the tiny random chat model, saved into folder, with a small KV cache: for tests that
    need real processes and the real tokenizer but not real text."""
    save_tiny_chat_model(folder / "tiny-chat")
    return Stack(folder, model=str(folder / "tiny-chat"), kv_cache_memory="16MiB", **kwargs)


def engine_texts(prompts: list[str], model: str | None = None, **sampling) -> list[str]:
    """What the in-process engine (the default model, or model) generates for each prompt: the reference a stack
    must match."""
    from kvferry.common.config import EngineConfig
    from kvferry.common.engine import LLMEngine
    from kvferry.common.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=256 * 2**20))
    return [out.text for out in engine.generate(prompts, SamplingParams(**sampling))]


@contextlib.contextmanager
def running_pair(log_dir: Path, **kwargs):
    """A Stack with the gateway and one worker of each role (prefill-a, decode-a), always cleaned up."""
    stack = Stack(log_dir, **kwargs)
    try:
        yield stack.start_pair()
    finally:
        stack.close()
