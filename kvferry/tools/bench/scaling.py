"""`kvferry bench scaling`: `kvferry serve` against llama.cpp's `llama-server` on the same weights, one after the
other on this machine: time from launch to serving, the proportional set size (PSS) of every process per token of
decode KV capacity, std-32's output rate and one stream's inter-token gap.

Each server runs alone (a resident stack beside the other slows it). PSS splits shared pages between the processes
that map them, so a prefill and a decode worker mapping one prepared file count it once. llama-server is run by the
path given, with `-np 32 -c CTX -t THREADS`; the recipe that makes the random-weight models and their GGUF files is in
docs/benchmarks.md ("Models of real sizes").
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvferry.tools.bench import workload
from kvferry.tools.bench.serve import replay
from kvferry.tools.bench.stack import served_model

WORKLOADS = ("single-stream", "std-32")  # one stream first, on an idle server: after std-32 llama-server's gap tripled
READY_TIMEOUT_S = 900.0  # a cold start quantizes a model of a few GB first


def process_tree(root: int) -> list[int]:
    """root and every process under it."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            pass
    return found


def pss_bytes(pids: list[int]) -> int:
    """The sum of the processes' proportional set sizes (a process gone in the meantime counts nothing)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _wait_healthy(url: str, proc: subprocess.Popen, started: float) -> float:
    """Seconds from started until url/health answers 200; a RuntimeError where the process ends first."""
    while time.perf_counter() - started < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"the server ended with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not serving after {READY_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen, sig: int) -> None:
    """Stop the server and its children (its own process group); SIGKILL after a minute."""
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)
    except ProcessLookupError:  # the group is gone already
        proc.wait()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(url: str, proc: subprocess.Popen, ready_s: float, kv_tokens, vocab_size: int, workloads) -> dict:
    """One short request, then the PSS of the tree, then each workload after a warm-up."""
    model = served_model(url)
    asyncio.run(replay(url, model, workload.warmup(vocab_size)))
    time.sleep(2)  # freed buffers returned, the resident set settled
    pss = pss_bytes(process_tree(proc.pid))
    tokens = kv_tokens()
    report = {"ready_s": round(ready_s, 1), "pss_gib": round(pss / 2**30, 2), "kv_tokens": tokens}
    if not tokens:
        raise SystemExit(f"bench scaling: the server at {url} reports no decode KV cache")
    report["pss_kib_per_kv_token"] = round(pss / 1024 / tokens, 1)
    for name in workloads:
        result = asyncio.run(replay(url, model, workload.generate(name, vocab_size)))
        report[name] = {k: result[k] for k in ("output_tok_per_s", "tpot_p50_ms", "ttft_p50_s", "elapsed_s")}
        print(f"  {name}: {report[name]}", file=sys.stderr, flush=True)
    return report


def _launch(command: list[str], log_path: Path, wait, port: int) -> tuple[subprocess.Popen, str, float]:
    """Start a server in its own process group, its output to log_path; (it, its URL, seconds until wait(url, proc,
    started) says it serves), or a SystemExit that names the log, the server stopped."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        return proc, url, wait(url, proc, started)
    except RuntimeError as exc:
        _stop(proc, signal.SIGTERM)
        raise SystemExit(f"bench scaling: {exc} ({log_path} says why)") from None
    except BaseException:
        _stop(proc, signal.SIGTERM)
        raise


def run_kvferry(args, port: int, vocab_size: int) -> dict:
    """`kvferry serve` on the model, from launch to serving (its log says whether it prepared the weights)."""
    command = [sys.executable, "-m", "kvferry.tools.cli", "serve", "--model", args.model, "--port", str(port),
               "--control-port", str(port + 1), "--quantization", args.quantization, *args.serve_arg]  # fmt: skip
    log_path = Path(args.log_dir) / "kvferry-serve.log"
    proc, url, ready_s = _launch(command, log_path, _wait_workers, port)
    try:

        def decode_tokens() -> int:
            workers = _get(url + "/v1/workers")["workers"]
            return sum(w["num_blocks"] * w["block_size"] for w in workers if w["role"] == "decode")

        report = measure(url, proc, ready_s, decode_tokens, vocab_size, args.workloads)
    finally:
        _stop(proc, signal.SIGTERM)
    report["start"] = "cold" if "prepared once" in log_path.read_text() else "warm"
    return report


def _wait_workers(url: str, proc: subprocess.Popen, started: float) -> float:
    """As _wait_healthy, until the gateway has a live prefill and decode worker."""
    _wait_healthy(url, proc, started)
    while time.perf_counter() - started < READY_TIMEOUT_S:
        try:
            roles = {w["role"] for w in _get(url + "/v1/workers")["workers"]}
            if {"prefill", "decode"} <= roles:
                return time.perf_counter() - started
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"kvferry serve ended with {proc.returncode} before serving")
        time.sleep(0.2)
    raise RuntimeError(f"no workers after {READY_TIMEOUT_S:.0f} s")


def run_llama_server(args, port: int, vocab_size: int) -> dict:
    command = [args.llama_server, "-m", args.gguf, "-np", "32", "-c", str(args.ctx), "-t", str(args.threads),
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    proc, url, ready_s = _launch(command, Path(args.log_dir) / "llama-server.log", _wait_healthy, port)
    try:
        return measure(url, proc, ready_s, lambda: args.ctx, vocab_size, args.workloads)
    finally:
        _stop(proc, signal.SIGINT)


def ratios(kv: dict, ll: dict) -> dict:
    """kvferry's figures over llama-server's: memory per KV token, std-32's rate, one stream's gap."""
    out = {"pss_per_kv_token": round(kv["pss_kib_per_kv_token"] / ll["pss_kib_per_kv_token"], 3)}
    if "std-32" in kv and "std-32" in ll:
        out["std32_tok_per_s"] = round(kv["std-32"]["output_tok_per_s"] / ll["std-32"]["output_tok_per_s"], 3)
    if "single-stream" in kv and "single-stream" in ll:
        out["one_stream_tpot"] = round(kv["single-stream"]["tpot_p50_ms"] / ll["single-stream"]["tpot_p50_ms"], 3)
    return out


def add_parser(bench) -> None:
    p = bench.add_parser(
        "scaling",
        help="kvferry serve against llama.cpp's llama-server on the same weights, one after the other: start time, "
        "PSS per KV token, std-32, one stream",
    )
    p.add_argument("--model", required=True, help="the model folder kvferry serves (e.g. bench random-model's)")
    p.add_argument("--gguf", required=True, help="the same weights as a GGUF file, for llama-server")
    p.add_argument("--llama-server", required=True, help="the path of llama.cpp's llama-server")
    p.add_argument("--quantization", default="int8", choices=("int8", "int4", "none"))
    p.add_argument("--ctx", type=int, default=20480, help="llama-server's -c: its KV tokens, shared by its 32 slots")
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for kvferry serve (repeat)")
    p.add_argument("--port", type=int, default=8177, help="kvferry's port (and +1 its control port); llama's +2")
    p.add_argument("--log-dir", default=".", help="where each server's log is written")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_scaling)


def cmd_bench_scaling(args) -> int:
    from kvferry.common.model_config import ModelConfig
    from kvferry.common.model_files import resolve_model

    for name in args.workloads:
        if name not in workload.NAMES:
            raise SystemExit(f"bench scaling: unknown workload {name!r}")
    if not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"bench scaling: {args.llama_server} is not an executable llama-server")
    vocab_size = ModelConfig.load(resolve_model(args.model)).vocab_size
    print(f"kvferry serve --quantization {args.quantization} ...", file=sys.stderr, flush=True)
    kv = run_kvferry(args, args.port, vocab_size)
    print(f"llama-server {Path(args.gguf).name} ...", file=sys.stderr, flush=True)
    ll = run_llama_server(args, args.port + 2, vocab_size)
    report = {"kvferry": kv, "llama_server": ll, "kvferry_over_llama_server": ratios(kv, ll)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\n== kvferry serve --quantization {args.quantization} against llama-server {Path(args.gguf).name} ==")
    print(f"| | kvferry ({kv['start']} start) | llama-server (-c {args.ctx}) | ratio |")
    print("| --- | --- | --- | --- |")
    r = report["kvferry_over_llama_server"]
    print(f"| from launch to serving | {kv['ready_s']} s | {ll['ready_s']} s | |")
    print(f"| PSS of every process | {kv['pss_gib']} GiB | {ll['pss_gib']} GiB | |")
    print(f"| decode KV tokens | {kv['kv_tokens']} | {ll['kv_tokens']} | |")
    print(f"| PSS per KV token | {kv['pss_kib_per_kv_token']} KiB | {ll['pss_kib_per_kv_token']} KiB "
          f"| {r['pss_per_kv_token']}x |")  # fmt: skip
    if "std32_tok_per_s" in r:
        print(f"| std-32 output tok/s | {kv['std-32']['output_tok_per_s']} | {ll['std-32']['output_tok_per_s']} "
              f"| {r['std32_tok_per_s']}x |")  # fmt: skip
    if "one_stream_tpot" in r:
        print(f"| one stream, TPOT p50 | {kv['single-stream']['tpot_p50_ms']} ms | "
              f"{ll['single-stream']['tpot_p50_ms']} ms | {r['one_stream_tpot']}x |")  # fmt: skip
    return 0
