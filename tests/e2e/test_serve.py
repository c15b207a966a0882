"""`kvferry serve`: its children (gateway, prefill, decode) run with serve's settings, from its flags and its
environment (the flag winning), as settings.child_environment hands them on."""

import os
from pathlib import Path

from kvferry.common import settings
from tests.e2e.stack import Stack
from tests.e2e.test_procfile import descendants
from tests.tiny_models import save_tiny_chat_model

KEY = "serve-key"


def test_serve_hands_its_flags_and_variables_to_its_children(make_stack, tmp_path, monkeypatch):
    save_tiny_chat_model(tmp_path / "tiny-chat")
    monkeypatch.chdir(tmp_path)  # the relative --trace-dir below lands here
    # A variable serve's flag overrides (a bad one: serve's children must get the flag's value, not this), one
    # that only serve's children read, and the API key, which serve reads and hands on.
    stack: Stack = make_stack(
        model=str(tmp_path / "tiny-chat"),
        extra_env={"KVFERRY_MAX_TOKENS_LIMIT": "lots", "KVFERRY_MAX_STOP": "1", "KVFERRY_API_KEY": KEY},
    )
    stack.start(
        "serve",
        "serve",
        *("--port", str(stack.port), "--control-port", str(stack.control_port)),
        *("--prefill-threads", "1", "--decode-threads", "1"),
        *("--max-tokens-limit", "8", "--max-n", "1", "--trace-dir", "traces", "--log-format", "json"),
        *("--kv-cache-memory", "64MiB", "--dtype", "float32"),  # engine settings, for the workers
    )
    stack.wait_for(lambda: stack.get("/health")[0] == 200, 240, "serve's stack healthy")
    assert {w["role"] for w in stack.workers().values()} == {"prefill", "decode"}

    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, reply = stack.post("/v1/completions", body, timeout=120)
    assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
    status, reply = stack.post("/v1/completions", {**body, "max_tokens": 9})  # --max-tokens-limit 8
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply
    status, reply = stack.post("/v1/completions", {**body, "n": 2})  # --max-n 1
    assert status == 400 and reply["error"]["param"] == "n", reply
    status, reply = stack.post("/v1/completions", {**body, "stop": ["a", "b"]})  # KVFERRY_MAX_STOP=1
    assert status == 400 and reply["error"]["param"] == "stop", reply
    stack.auth = {}
    assert stack.post("/v1/completions", body)[0] == 401  # KVFERRY_API_KEY

    traces = tmp_path / "traces"
    assert traces.is_dir() and len(os.listdir(traces)) >= 3, os.listdir(traces)  # each child writes its own
    assert any(line.startswith('{"ts"') for line in stack.log("serve").splitlines())  # --log-format json

    # The workers share the machine's cores: prefill's OpenMP threads spin only briefly when idle; the decode
    # worker, niced, keeps libgomp's default.
    children = descendants(stack.procs["serve"].pid)
    environs = {_role(pid): Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in children}
    assert b"GOMP_SPINCOUNT=10000" in environs["prefill"], environs["prefill"]
    assert not any(e.startswith(b"GOMP_SPINCOUNT=") for e in environs["decode"]), environs["decode"]
    for role in ("prefill", "decode"):  # serve's engine flags, as each worker reads them
        assert {b"KVFERRY_KV_CACHE_MEMORY=67108864", b"KVFERRY_DTYPE=float32"} <= set(environs[role]), environs[role]

    # The decode worker yields the cores to prefill: it and every thread it started run at serve's default niceness.
    niceness = {_role(pid): _niceness_of_threads(pid) for pid in children if _role(pid)}
    assert niceness["prefill"] == {0} and niceness["gateway"] == {0}, niceness
    assert niceness["decode"] == {int(settings.default("decode_nice"))} != {0}, niceness


def _role(pid: int) -> str | None:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return next((a.decode() for a in args if a in (b"gateway", b"prefill", b"decode")), None)


def _niceness_of_threads(pid: int) -> set[int]:
    # /proc/<pid>/task/<tid>/stat: the niceness is the 19th field; the 2nd, the name in parentheses, may hold spaces.
    stats = [(task / "stat").read_text() for task in Path(f"/proc/{pid}/task").iterdir()]
    return {int(stat.rsplit(")", 1)[1].split()[16]) for stat in stats}
