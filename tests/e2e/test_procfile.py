"""The repository's own Procfile, run by honcho as the README says: ports from the environment, two workers of each
role, real requests over HTTP, and a clean stop on SIGTERM with no process left behind."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from honcho.environ import expand_processes, parse, parse_procfile

from kvferry.common import settings
from tests.e2e.stack import tiny_stack
from tests.environment import lacking

ROOT = Path(__file__).resolve().parents[2]
PROCFILE = ROOT / "Procfile"
STOP_TIMEOUT_S = 60  # a hang guard only: honcho itself SIGKILLs what is left 5 s after the first process stops


def test_the_procfile_reads_kvferry_settings_and_falls_back_to_their_defaults():
    """Every variable the Procfile reads is honcho's PORT or one of kvferry's settings, each fallback is that setting's
    default, and with the committed .env a plain `honcho start` gives the gateway kvferry's default port."""
    text = PROCFILE.read_text()
    names = set(re.findall(r"\$\{?([A-Za-z_]\w*)", text))
    assert "PORT" in names
    by_env = {s.env: s for s in settings.SPEC}
    assert names - {"PORT"} <= set(by_env), f"not kvferry settings: {sorted(names - {'PORT'} - set(by_env))}"
    fallbacks = re.findall(r"\$\{(\w+):-([^}]*)\}", text)
    assert {var for var, _ in fallbacks} == names - {"PORT"}
    for var, value in fallbacks:
        assert by_env[var].parse(value) == by_env[var].value_default, f"{var}'s fallback in the Procfile"
    processes = parse_procfile(text).processes
    assert list(processes) == ["gateway", "prefill", "decode"]
    expanded = {p.name: p.env for p in expand_processes(processes, env=parse((ROOT / ".env").read_text()), port=5000)}
    assert expanded["gateway.1"]["PORT"] == str(settings.default("port"))
    # Prefill's OpenMP threads spin briefly; the decode worker's environment loses .env's value, as serve's lacks it.
    assert expanded["prefill.1"]["GOMP_SPINCOUNT"] == "10000"
    assert processes["decode"].startswith("exec env -u GOMP_SPINCOUNT nice ")


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, from /proc; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name, in parentheses, may hold spaces
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every process below root, as pid -> start time (a pid reused later is another process)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
            starts[int(entry.name)] = stat[2]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def running(procs: dict[int, int]) -> list[int]:
    """Those still running: present, the same process, and not a zombie waiting to be reaped."""
    return [pid for pid, start in procs.items() if (s := _stat(pid)) is not None and s[2] == start and s[1] != "Z"]


def test_honcho_runs_the_procfile_with_two_workers_of_each_role_and_stops_on_sigterm(tmp_path):
    if not (ROOT / ".venv" / "bin" / "kvferry").exists():
        lacking("the Procfile runs .venv/bin/kvferry, which `make install` creates")
    stack = tiny_stack(tmp_path)  # its free ports, its tiny model and small KV cache; honcho starts the processes
    env_file = tmp_path / "honcho.env"
    env_file.write_text(f"PORT={stack.port}\n")  # honcho's own way to set its base port, as the committed .env does
    env = {
        **stack.env,
        "KVFERRY_CONTROL_PORT": str(stack.control_port),
        "KVFERRY_PREFILL_THREADS": "1",
        "KVFERRY_DECODE_THREADS": "1",
    }
    env.pop("PROCFILE", None)
    log = open(tmp_path / "honcho.log", "w")
    honcho = subprocess.Popen(
        [sys.executable, "-m", "honcho", "start", "-e", str(env_file), "--no-colour", "-c", "prefill=2,decode=2"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    stack.procs["gateway-by-honcho"] = honcho  # Stack.wait_for gives up at once, with this log, if honcho exits
    (tmp_path / "gateway-by-honcho.log").symlink_to(tmp_path / "honcho.log")
    seen: dict[int, int] = {}
    try:
        stack.wait_for(
            lambda: sorted(w["role"] for w in stack.workers().values()) == ["decode", "decode", "prefill", "prefill"],
            180,
            "the gateway to list 2 prefill and 2 decode workers",
        )
        seen = descendants(honcho.pid)
        assert stack.get("/health")[0] == 200
        for i in range(6):
            status, body = stack.post(
                "/v1/completions",
                {"prompt": f"Request {i} of a few:", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 8
        events = stack.stream(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        )
        assert events[-1] == "[DONE]" and sum(len(e["choices"]) for e in events[:-1]) >= 1
        served = {w["id"]: w["requests_served"] for w in stack.workers().values()}
        assert all(n >= 1 for n in served.values()), served  # honcho's extra workers took requests too

        seen |= descendants(honcho.pid)
        honcho.send_signal(signal.SIGTERM)
        code = honcho.wait(timeout=STOP_TIMEOUT_S)
        out = (tmp_path / "honcho.log").read_text()
        assert code == 143, out[-3000:]  # honcho's exit code after a SIGTERM, once every process has stopped
        assert "SIGKILL" not in out, out[-3000:]  # none had to be killed
        stopped = dict(re.findall(r"^\S+ system\s*\| (\S+) stopped \(rc=(-?\d+)\)$", out, re.M))
        assert stopped == {n: "0" for n in ("gateway.1", "prefill.1", "prefill.2", "decode.1", "decode.2")}, out[-3000:]
        assert len(seen) >= 10  # honcho's five runners and the five kvferry processes under them
        assert running(seen) == []
    finally:
        for pid in running(seen | descendants(honcho.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stack.close()
        log.close()
