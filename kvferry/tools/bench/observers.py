"""`kvferry bench tracing` and `bench capture`: what message tracing or traffic capture costs, std-32 over HTTP with
it off and on.

Each round starts the stack (gateway, 1 prefill, 1 decode worker) once without and once with the observer's folder
(--trace-dir or --capture-dir), replays the workload against each, and stops it. Rounds alternate so that a slow
spell on a shared machine hits both sides; the best run of each side is compared.
"""

import asyncio
import json
import os
import shutil
import sys
import tempfile

from kvferry.common import settings
from kvferry.tools.bench import workload
from kvferry.tools.bench.serve import replay
from kvferry.tools.bench.stack import fresh_stack, served_model

OBSERVERS = {"tracing": "trace_dir", "capture": "capture_dir"}  # the bench's name -> the setting that turns it on


def _run(requests: list[dict], folder: str | None, args) -> dict:
    env = {settings.env_name(OBSERVERS[args.bench]): folder} if folder else {}
    with fresh_stack(args.model, env, prefill_threads=args.prefill_threads, decode_threads=args.decode_threads) as (
        url,
        _,
    ):
        model = served_model(url)
        asyncio.run(replay(url, model, requests[:2]))  # warm-up
        return asyncio.run(replay(url, model, requests))


def cmd_bench_observer(args) -> int:
    from kvferry.common.model_config import ModelConfig
    from kvferry.common.model_files import resolve_model

    requests = workload.generate(args.workload, ModelConfig.load(resolve_model(args.model)).vocab_size)
    what = args.bench
    off, on, written_bytes, written_lines = [], [], 0, 0
    for i in range(args.repeat):
        off.append(_run(requests, None, args))
        print(f"round {i + 1} {what} off: {off[-1]['output_tok_per_s']} tok/s", file=sys.stderr)
        folder = tempfile.mkdtemp(prefix=f"kvferry-{what}-")
        try:
            on.append(_run(requests, folder, args))
            files = [os.path.join(folder, f) for f in os.listdir(folder)]
            written_bytes = sum(os.path.getsize(f) for f in files)
            written_lines = sum(sum(1 for _ in open(f, encoding="utf-8")) for f in files)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"round {i + 1} {what} on:  {on[-1]['output_tok_per_s']} tok/s", file=sys.stderr)
    best_off = max(r["output_tok_per_s"] for r in off)
    best_on = max(r["output_tok_per_s"] for r in on)
    report = {
        "workload": args.workload,
        "off_tok_per_s": [r["output_tok_per_s"] for r in off],
        "on_tok_per_s": [r["output_tok_per_s"] for r in on],
        "best_off": best_off,
        "best_on": best_on,
        "overhead": round(1 - best_on / best_off, 4),
        "lines": written_lines,
        "bytes": written_bytes,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"\n== {args.workload} over HTTP, {what} off vs on ({args.repeat} rounds, best of each) ==")
        print(f"{what} off {best_off} tok/s (runs {report['off_tok_per_s']})")
        print(
            f"{what} on  {best_on} tok/s (runs {report['on_tok_per_s']}); {written_lines} lines, "
            f"{written_bytes / 2**20:.2f} MiB per run"
        )
        print(f"overhead of {what}: {report['overhead']:+.1%} of throughput")
    return 0
