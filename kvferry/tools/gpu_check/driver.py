"""Runs the GPU check's parts in order, each in a process group of its own under its own timeout plus the time
the parts before it left unused; the whole run ends within BUDGET_S of the script's start. A part that fails or
times out is recorded with its error, its first traceback and the end of its output; its whole process group is
killed and the next part runs. The report is rewritten after every part.
Exit status: 0 when every part passed, 1 when one failed, 2 when there is no usable GPU.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvferry.tools.gpu_check import part as part_module
from kvferry.tools.gpu_check.part import SOURCE_ROOT
from kvferry.tools.gpu_check.parts import BUDGET_S, DRY_RUN_ENV, DRY_RUN_SLOWDOWN, STARTED_ENV, Part, by_name
from kvferry.tools.gpu_check.report import Report

OUTPUT_TAIL_CHARS = 3000
REMOVE_ENV = "KVFERRY_GPU_CHECK_REMOVE"  # a folder scripts/gpu_check.sh leaves to the driver to remove
TRACEBACK_CHARS = 2000  # of a failed part's first traceback, in its output_tail


class Interrupted(Exception):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("outdir", help="where report.json, report.txt and log.txt go (created)")
    p.add_argument(
        "--prepared",
        default=str(SOURCE_ROOT / ".gpu-check"),
        help="the folder `make gpu-check-prepare` filled (model/ is read from it)",
    )
    p.add_argument("--parts", default=None, help="comma-separated part names to run (default: all, in order)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temporary folder with the built model")


def add_gpu_check_parser(sub) -> None:
    """`kvferry gpu-check OUTDIR`: this driver where kvferry is installed (scripts/gpu_check.sh runs it from a source
    tree, with the carried wheels)."""
    p = sub.add_parser(
        "gpu-check",
        help="everything that needs a CUDA GPU, in at most 7.5 minutes: kernels, graphs, benches, a real stack",
        description=__doc__,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvferry.tools.gpu_check", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args) -> int:
    dry_run = bool(os.environ.get(DRY_RUN_ENV))
    parts = by_name(args.parts.split(",") if args.parts else None)
    slowdown = DRY_RUN_SLOWDOWN if dry_run else 1
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvferry-gpu-check-"))
    mode = "cpu dry run (KVFERRY_GPU_CHECK_ALLOW_CPU: tests the check only, measures nothing)" if dry_run else "cuda"
    report = Report(out, mode, BUDGET_S * slowdown, [p.name for p in parts])
    log_path = out / "log.txt"
    log_path.write_text("")
    env = part_environment(work, Path(args.prepared), dry_run)
    deadline = time.monotonic() + _seconds_left(BUDGET_S * slowdown)
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    note, no_gpu, no_model = None, False, False
    try:
        for i, part in enumerate(parts, 1):
            if no_gpu:
                report.add(_skipped(part, "no CUDA GPU (see the environment part)"))
                continue
            if part.needs_model and no_model:
                report.add(_skipped(part, "the model part failed"))
                continue
            # Its own timeout and whatever the parts before it left unused, never the time of the parts after it;
            # but where the run is behind (a slow set-up), at least half its own, as far as the deadline allows.
            left = deadline - time.monotonic()
            after = sum(later.timeout_s for later in parts[i:]) * slowdown
            timeout = min(left, max(left - after, part.timeout_s * slowdown / 2))
            if timeout < 3:
                report.add(_skipped(part, "the run's time budget is spent"))
                continue
            print(f"gpu-check: [{i}/{len(parts)}] {part.name}: {part.what} (at most {timeout:.0f} s)", flush=True)
            entry = run_part(part, timeout, env, work, log_path)
            report.add(entry)
            detail = entry["summary"] if entry["status"] == "passed" else (entry["error"] or "").split("\n")[0][:300]
            print(f"gpu-check:   {entry['status'].upper()} in {entry['seconds']} s: {detail}", flush=True)
            if entry["status"] == "interrupted":
                raise Interrupted
            if part.name == "environment" and not dry_run:
                # Only torch saying so: the script has checked CUDA already, and a part that timed out or failed
                # for another reason says nothing about the GPU.
                no_gpu = entry["findings"].get("versions", {}).get("cuda_available") is False
            no_model = no_model or (part.name == "model" and entry["status"] != "passed")
    except Interrupted:
        note = "interrupted by a signal: the parts after the one running then were not run"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
        report.finish(note)
        if not args.keep_workdir:
            shutil.rmtree(work, ignore_errors=True)
        _remove_script_site()
    print(report.text(), end="", flush=True)
    print(f"gpu-check: the report is in {out}/report.json and report.txt, every part's output in {log_path}")
    if no_gpu:
        return 2
    return 0 if report.ok else 1


def _remove_script_site() -> None:
    """The folder scripts/gpu_check.sh installed the wheels into: it execs this driver, so its own clean-up is
    gone with it."""
    site = Path(os.environ.get(REMOVE_ENV, ""))
    if site.name.startswith("kvferry-gpu-check-site.") and site.is_dir():
        shutil.rmtree(site, ignore_errors=True)


def _seconds_left(budget: float) -> float:
    """The budget less what passed since scripts/gpu_check.sh started (STARTED_ENV), or all of it where that is
    unknown or implausible."""
    try:
        started = float(os.environ[STARTED_ENV])
    except (KeyError, ValueError):
        return budget
    passed = time.time() - started
    return budget - passed if 0 <= passed < budget else budget


def part_environment(work: Path, prepared: Path, dry_run: bool) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # on the GPU the kernels must compile; graph capture needs them compiled
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
        env.setdefault("KVFERRY_KV_CACHE_MEMORY", "64MiB")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SOURCE_ROOT), env.get("PYTHONPATH")]))
    env.update(
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",  # the GPU machine has no network: fail at once rather than wait on a connection
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TQDM_DISABLE="1",
        TOKENIZERS_PARALLELISM="false",
        KVFERRY_CACHE_DIR=str(work / "cache"),
    )
    env[part_module.WORK_ENV] = str(work)
    env[part_module.PREPARED_ENV] = str(prepared.resolve())
    return env


def run_part(part: Part, timeout: float, env: dict, work: Path, log_path: Path) -> dict:
    result_path = work / f"{part.name}.json"
    result_path.unlink(missing_ok=True)
    started = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"\n===== {part.name}: {part.what} ({time.strftime('%H:%M:%S')}, at most {timeout:.0f} s)\n")
        log.flush()
        offset = log.tell()
        # A process group of its own (not a session: the machine's own clean-up still reaches it), so that a
        # timeout kills the part's children too: a stack's gateway and workers hold the GPU.
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvferry.tools.gpu_check.run_part", part.name, part.code],
            env={**env, part_module.RESULT_ENV: str(result_path), part_module.TIMEOUT_ENV: f"{timeout:.1f}"},
            cwd=SOURCE_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            process_group=0,
        )
        stopped = None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stopped = "timed out"
        except Interrupted:
            stopped = "interrupted"
        finally:
            _kill_group(proc)  # whatever the part left running
    seconds = round(time.monotonic() - started, 1)
    try:
        found = json.loads(result_path.read_text())
    except (OSError, ValueError):  # the part died before it wrote, or mid-write
        found = {}
    entry = {
        "name": part.name,
        "what": part.what,
        "status": "passed",
        "seconds": seconds,
        "timeout_s": round(timeout),
        "summary": found.get("summary", ""),
        "error": found.get("error"),
        "findings": found.get("findings", {}),
    }
    if stopped == "timed out":
        entry.update(status=stopped, error=f"timed out after {timeout:.0f} s; " + (entry["error"] or ""))
    elif stopped:
        entry.update(status=stopped, error="the check was stopped by a signal while this part ran")
    elif proc.returncode != 0 or not found.get("ok"):
        entry.update(status="failed", error=entry["error"] or f"exited with status {proc.returncode}")
    if entry["status"] != "passed":
        entry["output_tail"] = _output_tail(log_path, offset, entry["status"] == "failed")
    return entry


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGTERM:
            # Give a stack's processes a moment to end their children and release the GPU on SIGTERM.
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.5)
    proc.wait()


def _output_tail(log_path: Path, offset: int, failed: bool) -> str:
    """The part's output since offset, cut to what says why: for a part that failed, its first traceback (what
    came after it, a stack's shutdown say, is mostly its consequence) and then the output's last lines; for one
    that timed out, the last lines (what it was doing)."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    if len(text) <= OUTPUT_TAIL_CHARS:
        return text
    traceback = _first_traceback(text) if failed else None
    if traceback is None:
        return "..." + text[-OUTPUT_TAIL_CHARS:]
    if len(traceback) > TRACEBACK_CHARS:  # its end names the error; its start, where it began
        traceback = traceback[: TRACEBACK_CHARS // 4] + "\n...\n" + traceback[-TRACEBACK_CHARS * 3 // 4 :]
    rest = OUTPUT_TAIL_CHARS - len(traceback)
    return f"{traceback}\n... (the output's end:)\n...{text[-rest:]}" if rest > 200 else traceback


def _first_traceback(text: str) -> str | None:
    """The first Python traceback in text, with the exceptions chained to it, up to the last one's message."""
    start = text.find(part_module.TRACEBACK)
    if start < 0:
        return None
    lines = text[start:].splitlines()
    i = 1
    while i < len(lines):
        if lines[i].startswith((" ", "\t", "Traceback")) or not lines[i].strip():  # a frame
            i += 1
            continue
        # The exception's line, and its message: up to a blank line (at most 15 lines).
        end = min(len(lines), i + 15)
        i += 1
        while i < end and lines[i].strip() and not lines[i].startswith(("gpu-check:", "Traceback")):
            i += 1
        after = next((j for j in range(i, len(lines)) if lines[j].strip()), len(lines))
        if after < len(lines) and lines[after].startswith(("During handling", "The above exception")):
            i = after + 1  # a chained exception's traceback follows
            continue
        break
    return "\n".join(lines[:i])


def _skipped(part: Part, why: str) -> dict:
    return {"name": part.name, "what": part.what, "status": "skipped", "seconds": 0.0, "summary": "", "error": why}


def _raise_interrupted(*_):
    raise Interrupted
