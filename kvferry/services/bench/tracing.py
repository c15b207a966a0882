"""`kvferry bench tracing`: what message tracing costs, std-32 over HTTP with tracing off and on.

Each round starts the stack (gateway, 1 prefill, 1 decode worker) once without and once with
--trace-dir, replays the workload against each, and stops it. Rounds alternate so that a slow
spell on a shared machine hits both sides; the best run of each side is compared.
"""
import asyncio
import json
import os
import shutil
import sys
import tempfile
import urllib.request

from kvferry.services.bench import workload
from kvferry.services.bench.serve import replay
from kvferry.services.launcher import free_port, start_services, stop_all


def _run(requests: list[dict], trace_dir: str | None, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KVFERRY_TRACE_DIR", "KVFERRY_OTLP_ENDPOINT")}
    if trace_dir:
        env["KVFERRY_TRACE_DIR"] = trace_dir
    if args.model:
        env["KVFERRY_MODEL"] = args.model
    port = free_port()
    procs = start_services("127.0.0.1", port, free_port(), args.prefill_threads, args.decode_threads, env)
    try:
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        asyncio.run(replay(url, model, requests[:2]))  # warm-up
        return asyncio.run(replay(url, model, requests))
    finally:
        stop_all(procs)


def cmd_bench_tracing(args) -> int:
    from transformers import AutoConfig

    from kvferry.common.model.loader import resolve_model

    requests = workload.generate(args.workload, AutoConfig.from_pretrained(resolve_model(args.model)).vocab_size)
    off, on, trace_bytes, trace_lines = [], [], 0, 0
    for i in range(args.repeat):
        off.append(_run(requests, None, args))
        print(f"round {i + 1} tracing off: {off[-1]['output_tok_per_s']} tok/s", file=sys.stderr)
        trace_dir = tempfile.mkdtemp(prefix="kvferry-trace-")
        try:
            on.append(_run(requests, trace_dir, args))
            files = [os.path.join(trace_dir, f) for f in os.listdir(trace_dir)]
            trace_bytes = sum(os.path.getsize(f) for f in files)
            trace_lines = sum(sum(1 for _ in open(f, encoding="utf-8")) for f in files)
        finally:
            shutil.rmtree(trace_dir, ignore_errors=True)
        print(f"round {i + 1} tracing on:  {on[-1]['output_tok_per_s']} tok/s", file=sys.stderr)
    best_off = max(r["output_tok_per_s"] for r in off)
    best_on = max(r["output_tok_per_s"] for r in on)
    report = {"workload": args.workload, "off_tok_per_s": [r["output_tok_per_s"] for r in off],
              "on_tok_per_s": [r["output_tok_per_s"] for r in on], "best_off": best_off, "best_on": best_on,
              "overhead": round(1 - best_on / best_off, 4), "trace_lines": trace_lines, "trace_bytes": trace_bytes}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"\n== {args.workload} over HTTP, tracing off vs on ({args.repeat} rounds, best of each) ==")
        print(f"tracing off {best_off} tok/s (runs {report['off_tok_per_s']})")
        print(f"tracing on  {best_on} tok/s (runs {report['on_tok_per_s']}); {trace_lines} trace lines, "
              f"{trace_bytes / 2**20:.1f} MiB per run")
        print(f"overhead of tracing: {report['overhead']:+.1%} of throughput")
    return 0
