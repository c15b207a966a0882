"""What a part of the GPU check works with, in its own process (run_part.py): its Context, and PartFailed. Its
findings are rewritten to the file RESULT_ENV names at each one: the driver still has them after a timeout.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvferry.tools.gpu_check.parts import DRY_RUN_ENV
from kvferry.tools.gpu_check.report import write_whole

RESULT_ENV = "KVFERRY_GPU_CHECK_RESULT"
WORK_ENV = "KVFERRY_GPU_CHECK_WORK"
PREPARED_ENV = "KVFERRY_GPU_CHECK_PREPARED"
TIMEOUT_ENV = "KVFERRY_GPU_CHECK_PART_TIMEOUT"  # the part's timeout, in seconds: the driver kills it then
SOURCE_ROOT = Path(__file__).resolve().parents[3]
FAILED_OUTPUT_CHARS = 1500  # of a failing command's output, in its PartFailed message
TRACEBACK = "Traceback (most recent call last):"


class PartFailed(Exception):
    """A check that ran and found something wrong; what it found is recorded."""


class Context:
    def __init__(self):
        self.result_path = Path(os.environ[RESULT_ENV])
        self.work = Path(os.environ[WORK_ENV])
        self.prepared = Path(os.environ[PREPARED_ENV])
        self.model_dir = self.work / "model"
        self.dry_run = bool(os.environ.get(DRY_RUN_ENV))
        self._deadline = time.monotonic() + float(os.environ.get(TIMEOUT_ENV) or 600)
        self.findings: dict = {}
        self.summary = ""
        self._write(None, None)

    def seconds_left(self) -> float:
        """Until the driver kills this part."""
        return self._deadline - time.monotonic()

    def record(self, key: str, value) -> None:
        self.findings[key] = value
        self._write(None, None)

    def finish(self, ok: bool, error: str | None) -> None:
        self._write(ok, error)

    def _write(self, ok, error) -> None:
        data = {"ok": ok, "error": error, "summary": self.summary, "findings": self.findings}
        write_whole(self.result_path, json.dumps(data, default=str))

    @staticmethod
    def kvferry(*args: str) -> list[str]:
        return [sys.executable, "-m", "kvferry.tools.cli", *map(str, args)]

    def run_json(self, argv: list[str], env: dict | None = None) -> tuple[dict, str]:
        """Run a command that prints one JSON object on stdout; returns it and the command's stderr (logged)."""
        stdout: list[str] = []
        returncode, stderr = stream(argv, env, stdout)
        what = " ".join(argv[3:])
        if returncode != 0:
            raise PartFailed(f"`{what}` exited with status {returncode}:\n{excerpt(stderr)}")
        for line in reversed(stdout):
            if line.startswith("{"):
                return json.loads(line), stderr
        raise PartFailed(f"`{what}` printed no JSON object:\n{excerpt(stderr)}")


def excerpt(output: str, limit: int = FAILED_OUTPUT_CHARS) -> str:
    """What says why a command failed, in at most limit characters: from its last traceback on (a command's
    fatal error is the last thing it prints), else its last lines."""
    start = output.rfind(TRACEBACK)
    text = output[start:] if start >= 0 else output
    text = text.rstrip()
    return text if len(text) <= limit else "..." + text[-limit:]


def stream(argv: list[str], env: dict | None = None, stdout: list[str] | None = None) -> tuple[int, str]:
    """Run a command, its output copied to this part's log line by line (a part killed mid-command still leaves
    it there); returns its exit status and that output. stdout: a list to collect stdout in apart (logged at the
    end), or None to log it with the rest."""
    print("gpu-check: $ " + " ".join(map(str, argv)), file=sys.stderr, flush=True)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stdout is not None else subprocess.STDOUT,
        text=True,
        env=env,
        cwd=SOURCE_ROOT,
    )
    reader = None
    if stdout is not None:
        reader = threading.Thread(target=lambda: stdout.extend(proc.stdout), daemon=True)
        reader.start()
    logged = []
    for line in proc.stderr if stdout is not None else proc.stdout:
        logged.append(line)
        sys.stderr.write(line)
        sys.stderr.flush()
    proc.wait()
    if reader is not None:
        reader.join()
        print("".join(stdout), file=sys.stderr, flush=True)
    return proc.returncode, "".join(logged)
