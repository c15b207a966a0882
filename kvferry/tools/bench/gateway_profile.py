"""`kvferry bench gateway --profile`: py-spy records a gateway process over the measured runs, and its collapsed
stacks come back as the functions most often on the CPU, themselves and anywhere on the stack."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvferry.common.errors import KvferryError
from kvferry.services.launcher import child_setup

PROFILE_TOP = 15
PROFILE_RATE_HZ = 200  # py-spy pauses the gateway this often to read its stack: a profiled run's figures are slower
PROFILED = (
    f"profiled: py-spy paused the gateway {PROFILE_RATE_HZ} times a second, so its tok/s and CPU per token are not "
    "comparable with an unprofiled run's"
)
# The event loop's own dispatch frames, as _function names them: on nearly every sample of the loop's thread, they
# say nothing. By name, as a share misses them: Handle._run was on 98.4% of one profile's samples, not 99.
LOOP_FRAMES = frozenset(
    {
        "Handle._run (asyncio/events.py)",
        "BaseEventLoop._run_once (asyncio/base_events.py)",
        "BaseEventLoop.run_forever (asyncio/base_events.py)",
        "BaseEventLoop.run_until_complete (asyncio/base_events.py)",
        "Runner.run (asyncio/runners.py)",
        "run (asyncio/runners.py)",
    }
)
ON_EVERY_SAMPLE = 0.99  # a frame on this share of its thread's samples (runpy's, the command's main) says nothing


def start_profile(pid: int, out: str, cpus: set[int] | None) -> subprocess.Popen:
    spy = Path(sys.executable).with_name("py-spy")
    command = [str(spy) if spy.exists() else "py-spy", "record", "--pid", str(pid), "--rate", str(PROFILE_RATE_HZ)]
    # --gil: only what holds the interpreter (idle threads of a pool would count otherwise). Blocking (the gateway
    # paused for each sample): read without pausing, a third of the stacks came out cut short.
    command += ["--gil", "--format", "raw", "--output", out]
    try:
        proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=child_setup(os.getpid(), cpus=cpus)
        )
    except FileNotFoundError:
        raise KvferryError("--profile needs py-spy: pip install py-spy") from None
    time.sleep(1.0)  # attached before the load starts
    if proc.poll() is not None:
        raise KvferryError(f"py-spy did not attach to the gateway: {proc.stderr.read().decode()[-500:]}")
    return proc


def stop_profile(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
    proc.wait(timeout=60)


def profile_top(path: str, top: int = PROFILE_TOP) -> dict:
    """py-spy's collapsed stacks (`frame;frame;... count`, each frame `function (file:line)`) as the functions
    most often on the CPU themselves (self) and anywhere on its stack (cumulative), as shares of the samples. The
    cumulative list leaves out the event loop's dispatch frames (LOOP_FRAMES) and any frame on 99% or more of its
    thread's samples (runpy's, the command's main), which say nothing."""
    own, anywhere, root_of, per_root, total = {}, {}, {}, {}, 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames, n = [_function(frame) for frame in stack.split(";")], int(count)
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        per_root[frames[0]] = per_root.get(frames[0], 0) + n
        for frame in set(frames):
            anywhere[frame] = anywhere.get(frame, 0) + n
            root_of.setdefault(frame, frames[0])
    telling = {f: n for f, n in anywhere.items() if f not in LOOP_FRAMES and n < ON_EVERY_SAMPLE * per_root[root_of[f]]}

    def ranked(counts: dict) -> list:
        best = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]
        return [[name, round(n / max(total, 1), 4)] for name, n in best]

    return {"samples": total, "self": ranked(own), "cumulative": ranked(telling)}


def _function(frame: str) -> str:
    """`name (path/to/file.py:123)` -> `name (file.py)`: one function, whatever its line."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rpartition(":")[0] or where.rstrip(")")
    return f"{name} ({'/'.join(path.split('/')[-2:])})"
