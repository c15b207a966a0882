"""`kvferry bench simulator`: the simulator's predictions against real stacks on this machine.

For each shape (P prefill, D decode workers) and workload (std-32 all at once and at a Poisson rate), a fresh stack
captures the workload (the warm-up left out), and `kvferry simulate` replays the capture with the given cost model
and the stack's placement. TTFT and inter-token latency, as the gateway sees them, are printed side by side. The
CPU the gateway and this load generator used beside the workers goes to the simulator as background threads.
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvferry.common import capture, settings
from kvferry.tools import percentiles
from kvferry.tools.bench import workload
from kvferry.tools.bench.serve import replay
from kvferry.tools.bench.stack import fresh_stack, served_model

BACKGROUND_FILE = "background.json"  # beside a kept capture: the gateway's and the load generator's CPU share


def add_parser(bench) -> None:
    p = bench.add_parser("simulator", help="kvferry simulate against real stacks: predicted and measured latency")
    p.add_argument("--costs", required=True, help="the cost model, from kvferry bench costs")
    p.add_argument("--shapes", default="1x1,2x1,1x2", help="PxD shapes to run, comma-separated")
    p.add_argument("--rate", type=float, default=0.5, help="the Poisson workload's requests per second")
    p.add_argument("--model", default=None)
    p.add_argument("--prefill-threads", type=int, default=settings.default("prefill_threads"))
    p.add_argument("--decode-threads", type=int, default=settings.default("decode_threads"))
    p.add_argument("--keep", help="keep the captures in this folder (default: a temporary one, removed)")
    p.add_argument(
        "--captured", metavar="DIR", help="simulate the captures an earlier --keep DIR kept, without running stacks"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_simulator)


def _capture(shape: tuple[int, int], requests: list[dict], warmup: list[dict], folder: Path, args) -> Path:
    """Run the workload on a fresh stack of this shape, capturing; the folder of its workload lines."""
    raw = folder / "raw"
    env = {settings.env_name("capture_dir"): str(raw)}
    threads = dict(prefill_threads=args.prefill_threads, decode_threads=args.decode_threads)
    with fresh_stack(args.model, env, shape[0], shape[1], **threads) as (url, procs):
        model = served_model(url)
        asyncio.run(replay(url, model, warmup))
        before, started = _cpu_s(procs[0].pid), time.perf_counter()  # procs[0]: the gateway
        asyncio.run(replay(url, model, requests))
        after, elapsed = _cpu_s(procs[0].pid), time.perf_counter() - started
        background = (after[0] - before[0] + after[1] - before[1]) / elapsed
    records = capture.load([raw])[len(warmup) :]  # the warm-up's left out; every line flushed by the stopped gateway
    kept = folder / "workload"
    kept.mkdir()
    (kept / f"{capture.FILE_PREFIX}workload{capture.FILE_SUFFIX}").write_text("".join(r.to_line() for r in records))
    (folder / BACKGROUND_FILE).write_text(json.dumps({"background_threads": round(background, 3)}))
    return kept


def _cpu_s(gateway_pid: int) -> tuple[float, float]:
    """(the gateway's CPU seconds, this process's: the load generator's)."""
    fields = open(f"/proc/{gateway_pid}/stat").read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    mine = os.times()
    return (int(fields[11]) + int(fields[12])) / ticks, mine.user + mine.system


def _measured(folder: Path) -> dict:
    records = capture.load([folder])
    return {
        "ttft": percentiles.summary([r.ttft_s for r in records if r.ttft_s is not None], digits=6),
        "itl": percentiles.summary([g for r in records for gaps in r.itl_s for g in gaps], digits=6),
        "requests": len(records),
    }


def _predicted(folder: Path, shape: tuple[int, int], args) -> dict:
    background = json.loads((folder.parent / BACKGROUND_FILE).read_text())["background_threads"]
    command = [sys.executable, "-m", "kvferry.tools.cli", "simulate", str(folder), "--costs", args.costs]
    command += ["--background-threads", str(background)]
    command += ["--prefill", str(shape[0]), "--decode", str(shape[1]), "--cores", str(os.cpu_count()), "--json"]
    command += ["--prefill-threads", str(args.prefill_threads), "--decode-threads", str(args.decode_threads)]
    if args.model:
        command += ["--model", args.model]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    summary = json.loads(done.stdout)["summary"]
    return {"ttft": summary["ttft"], "itl": summary["itl"], "wall_s": summary["wall_s"], "background": background}


def cmd_bench_simulator(args) -> int:
    from kvferry.common.model_config import ModelConfig
    from kvferry.common.model_files import resolve_model

    vocab_size = ModelConfig.load(resolve_model(args.model)).vocab_size
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    workloads = {"std-32": workload.generate("std-32", vocab_size)}
    workloads[f"poisson-{args.rate:g}"] = workload.generate("std-32", vocab_size, rate=args.rate, seed=1)
    warmup = workload.warmup(vocab_size)
    root = Path(args.captured or args.keep or tempfile.mkdtemp(prefix="kvferry-simcheck-"))
    rows = []
    for shape in shapes:
        for name, requests in workloads.items():
            folder = root / f"{shape[0]}x{shape[1]}-{name}"
            if args.captured:
                kept = folder / "workload"
            else:
                folder.mkdir(parents=True, exist_ok=True)
                kept = _capture(shape, requests, warmup, folder, args)
            row = {"shape": f"{shape[0]}P+{shape[1]}D", "workload": name, "capture": str(kept)}
            row.update(measured=_measured(kept), predicted=_predicted(kept, shape, args))
            rows.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print("\n".join(["", _header()] + [_line(row) for row in rows]))
    if not args.keep and not args.captured:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


def _header() -> str:
    cells = [f"{what} {q} ms measured / predicted (ratio)" for what in ("TTFT", "ITL") for q in ("p50", "p90")]
    return f"{'shape':<8}{'workload':<14}{'bg':>6}" + "".join(f"{c:>38}" for c in cells)


def _line(row: dict) -> str:
    cells = []
    for what in ("ttft", "itl"):
        for q in ("p50", "p90"):
            m, p = row["measured"][what][q], row["predicted"][what][q]
            ratio = f"{p / m:.2f}" if m and p is not None else "-"
            cells.append(f"{(m or 0) * 1000:.1f} / {(p or 0) * 1000:.1f} ({ratio})")
    background = f"{row['predicted']['background']:.2f}"
    return f"{row['shape']:<8}{row['workload']:<14}{background:>6}" + "".join(f"{c:>38}" for c in cells)
