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
from kvferry.tools.gpu_check.part import Context, PartFailed, excerpt
from kvferry.tools.gpu_check.parts import BUDGET_S, PARTS, Part

pytestmark = pytest.mark.slow  # seconds of work: `make check` leaves it to `make test`

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


def test_without_the_prepared_folder_the_script_says_to_carry_it(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "KVFERRY_GPU_CHECK_ALLOW_CPU": "1"}
    env["KVFERRY_GPU_CHECK_PREPARED"] = str(tmp_path / "not-carried")
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    report = (tmp_path / "out" / "report.txt").read_text()
    assert "nothing was run" in report and 'carry: [".gpu-check"]' in report
    assert 'carry: [".gpu-check"]' in done.stderr


def test_the_deadline_counts_from_the_scripts_start(monkeypatch):
    monkeypatch.setenv(driver.STARTED_ENV, str(time.time() - 40))
    assert 244 < driver._seconds_left(285) <= 245
    monkeypatch.setenv(driver.STARTED_ENV, "not a time")
    assert driver._seconds_left(285) == 285


def test_a_failed_parts_output_tail_is_its_first_traceback_then_the_end(tmp_path):
    log = tmp_path / "log.txt"
    cause = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\nValueError: the cause\n'
    shutdown = "".join(f"INFO worker shutting down, line {i}\n" for i in range(400))
    later = 'Traceback (most recent call last):\n  File "y.py", line 2\nKeyboardInterrupt\n'
    log.write_text("start\n" + cause + shutdown + later + "the last line\n")
    tail = driver._output_tail(log, 0, failed=True)
    assert tail.startswith(cause.rstrip()) and "the last line" in tail and len(tail) < 3200
    assert "ValueError: the cause" not in driver._output_tail(log, 0, failed=False)  # timed out: the end


def test_a_failing_commands_message_ends_with_its_last_traceback():
    output = "noise\n" * 1000 + 'Traceback (most recent call last):\n  File "z"\nRuntimeError: boom\n'
    assert excerpt(output).startswith("Traceback") and excerpt(output).endswith("RuntimeError: boom")
    assert len(excerpt("x" * 5000)) == 1503


class _Logprobs:
    def __init__(self, token, logprob, tops):
        self.token_id, self.logprob = token, logprob
        self.top_ids, self.top_logprobs = tuple(tops), tuple(tops.values())


def test_graphs_against_eager_tells_a_near_tie_from_a_real_difference():
    from kvferry.tools.gpu_check.decode_parts import _agreement

    lp = _Logprobs(5, -1.0, {5: -1.0, 7: -1.0004, 9: -3.0})
    reference = {"a": ([1, 5], [lp, lp]), "b": ([1, 5], [lp, lp]), "c": ([1, 5], [lp, lp]), "d": ([2], [lp])}
    other = {"a": ([1, 7], []), "b": ([1, 9], []), "c": ([1, 4], []), "d": ([2], [])}
    found = _agreement(reference, other)
    assert found["identical_outputs"] == "1/4" and found["prefix_agreement"] == round(4 / 7, 4)
    margins = {k: w["margin"] for k, w in found["first_divergence"].items()}
    assert margins == {"a": 0.0004, "b": 2.0, "c": None}  # c: the other's token is not in the top ones


class _DeadManager:
    """transformers' manager after its generation thread died: no more results, not running."""

    def __init__(self):
        self.background_thread_status = type("Status", (), {"fatal_error": ValueError("out of pages")})()
        self.added, self.stopped = [], False

    def start(self):
        pass

    def add_request(self, input_ids, request_id=None, max_new_tokens=None):  # no eos_token_id: not passed
        self.added.append(request_id)

    def get_result(self, timeout=None):
        return None

    def is_running(self):
        return False

    def stop(self, block=True):
        self.stopped = True


def test_the_transformers_baseline_raises_what_killed_its_thread_and_passes_only_names_it_takes():
    from kvferry.tools.bench.hf_baseline import run_hf_continuous_batching

    manager = _DeadManager()

    class Model:
        def init_continuous_batching(self, generation_config=None, continuous_batching_config=None):
            return manager

    requests = [{"id": "r0", "prompt_token_ids": [1, 2], "max_tokens": 3}]
    with pytest.raises(RuntimeError, match="stopped after 0 of 1 requests: ValueError: out of pages"):
        run_hf_continuous_batching(Model(), requests, timeout_s=30)
    assert manager.added == ["r0"] and manager.stopped


def test_the_parts_timeouts_leave_the_scripts_set_up_its_seconds_within_the_budget():
    # The script may spend 20 s (wheels, a first import of torch) before the driver starts: a part whose
    # timeout grows past what is left would be clipped, and the last parts would run out of time.
    assert sum(p.timeout_s for p in PARTS) + 20 <= BUDGET_S
