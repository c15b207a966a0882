"""The GPU check's own plumbing, on the CPU: it refuses to run without a GPU, and its driver records a part that
passes, one that fails and one that hangs (killed with what it started), rewriting the report after each."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvferry.tools.gpu_check import driver
from kvferry.tools.gpu_check.part import Context, PartFailed
from kvferry.tools.gpu_check.parts import Part

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_the_script_fails_at_once_saying_it_needs_one(tmp_path):
    import torch  # here, not at the top: the driver test's parts import this module, and need no torch

    if torch.cuda.is_available():
        pytest.skip("a machine with a GPU runs the check instead of refusing it")
    env = {k: v for k, v in os.environ.items() if k != "KVFERRY_GPU_CHECK_ALLOW_CPU"}
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path / "out")],
        cwd=ROOT,
        env={**env, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert time.monotonic() - started < 30
    assert "needs a machine with an NVIDIA GPU" in done.stderr
    assert "needs a machine with an NVIDIA GPU" in (tmp_path / "out" / "report.txt").read_text()


# The parts the driver test runs, each in its own process (driver.run_part imports them by name).
def passes(ctx: Context) -> None:
    ctx.record("answer", 42)
    ctx.summary = "all good"


def fails(ctx: Context) -> None:
    ctx.record("found before failing", [1, 2])
    print("the reason is in this output")
    raise PartFailed("found a problem")


def hangs(ctx: Context) -> None:
    child = subprocess.Popen(["sleep", "300"])  # like a stack's worker: must not outlive the timeout
    ctx.record("child", child.pid)
    time.sleep(300)


def test_the_driver_records_each_part_and_goes_on_after_a_failure_and_a_timeout(tmp_path, monkeypatch):
    here = __name__
    parts = [
        Part("first", 4, "passes", f"{here}:passes", False),
        Part("second", 4, "fails", f"{here}:fails", False),
        Part("third", 2, "hangs", f"{here}:hangs", False),
        Part("fourth", 10, "passes again", f"{here}:passes", False),
    ]
    monkeypatch.setattr(driver, "by_name", lambda names: parts)
    monkeypatch.setattr(driver, "BUDGET_S", sum(p.timeout_s for p in parts))
    path = os.pathsep.join([str(ROOT), str(Path(__file__).parent)])  # however pytest named this module
    real_environment = driver.part_environment
    monkeypatch.setattr(driver, "part_environment", lambda *a: {**real_environment(*a), "PYTHONPATH": path})
    args = driver.argparse.Namespace(outdir=str(tmp_path), prepared=str(tmp_path), parts=None, keep_workdir=False)

    assert driver.run(args) == 1

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["finished"] and report["ok"] is False
    first, second, third, fourth = report["parts"]
    assert (first["status"], first["summary"], first["findings"]) == ("passed", "all good", {"answer": 42})
    assert second["status"] == "failed" and second["error"] == "found a problem"
    assert second["findings"] == {"found before failing": [1, 2]}
    assert "the reason is in this output" in second["output_tail"]
    # Its own 2 s and what the parts before it left unused, but none of the fourth's 10 s.
    assert third["status"] == "timed out" and 2 < third["timeout_s"] <= 10 and third["seconds"] < 15
    assert fourth["status"] == "passed"
    assert not _alive(third["findings"]["child"])
    text = (tmp_path / "report.txt").read_text()
    assert "FAILED    second" in text and "TIMED OUT third" in text and "2/4 parts passed" in text


def _alive(pid: int) -> bool:
    deadline = time.monotonic() + 5  # a killed child is reaped by whoever inherits it, a moment later
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True
