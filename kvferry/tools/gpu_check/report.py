"""The GPU check's report: OUTDIR/report.json, rewritten whole after each part (always valid JSON), and
OUTDIR/report.txt: what went wrong in each part that did not pass, then one line per part (the lines last, so
that the end of a printed report, which is what a console keeps, holds them)."""

import json
import os
import platform
import subprocess
import time
from pathlib import Path

DETAIL_CHARS = 1500  # of a part's error, and of its output where the error says little, in report.txt


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


class Report:
    def __init__(self, out: Path, mode: str, budget_s: float, part_names: list[str]):
        self.out = out
        status = _git("status", "--porcelain", "--untracked-files=no")
        self.data = {
            "check": "kvferry gpu-check",
            "mode": mode,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "host": platform.node(),
            "commit": _git("rev-parse", "HEAD"),
            "uncommitted_changes": None if status is None else bool(status),
            "budget_s": budget_s,
            "planned": part_names,
            "parts": [],
            "finished": False,
            "ok": None,
            "elapsed_s": 0.0,
        }
        self._started = time.monotonic()
        self.write()

    @property
    def ok(self) -> bool:
        return all(p["status"] == "passed" for p in self.data["parts"])

    def add(self, entry: dict) -> None:
        self.data["parts"].append(entry)
        self.write()

    def finish(self, note: str | None = None) -> None:
        self.data.update(finished=True, ok=self.ok, note=note)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self._started, 1)
        write_whole(self.out / "report.json", json.dumps(self.data, indent=1, default=str) + "\n")
        write_whole(self.out / "report.txt", self.text())

    def text(self) -> str:
        d = self.data
        lines = [
            f"kvferry gpu-check ({d['mode']}), started {d['started']} on {d['host']}, commit {d['commit']}"
            + (" with uncommitted changes" if d["uncommitted_changes"] else ""),
        ]
        for p in d["parts"]:
            if p["status"] in ("passed", "skipped"):
                continue
            lines.append(f"--- {p['name']} {p['status'].upper()}: {_cut(p['error'] or '')}")
            if len(p["error"] or "") < 300 and p.get("output_tail"):
                lines.append(f"--- {p['name']}'s output (log.txt has all of it):\n{_cut(p['output_tail'])}")
        for p in d["parts"]:
            detail = p["summary"] if p["status"] == "passed" else (p["error"] or "")
            detail = " ".join(str(detail).split())[:400]
            lines.append(f"{p['status'].upper():<9} {p['name']:<16} {p['seconds']:>6.1f} s  {detail}")
        done = [p["name"] for p in d["parts"]]
        missing = [n for n in d["planned"] if n not in done]
        passed = sum(p["status"] == "passed" for p in d["parts"])
        state = "finished" if d["finished"] else "RUNNING or cut off"
        lines.append(
            f"{passed}/{len(d['planned'])} parts passed, {d['elapsed_s']} s, {state}"
            + (f"; not run: {', '.join(missing)}" if missing else "")
            + (f"; {d['note']}" if d.get("note") else "")
        )
        return "\n".join(lines) + "\n"


def _cut(text: str) -> str:
    text = text.strip()
    return text if len(text) <= DETAIL_CHARS else "..." + text[-DETAIL_CHARS:]


def write_whole(path: Path, text: str) -> None:
    """Write whole or not at all: a reader (or a run killed mid-write) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
