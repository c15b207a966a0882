"""`kvferry bench gateway`: the serving path alone. The real gateway (one process, pinned to one core) serves
synthetic workers (TEST DOUBLES, bench/synthetic/) that cost nothing per token but their messages, and a cheap raw
client (bench/sse_load.py, on the other cores with the doubles) streams N chat completions at once, each of --tokens
tokens with ignore_eos and a stop string that never matches, so that detokenization and the stop-string check run.

Per stream count it reports the streamed tokens per second, each process's CPU seconds per token over the load
(/proc/PID/stat for the gateway and the doubles, the client's own process time), and the gateway's event-loop lag
over the load (the delta of its kvferry:gateway_event_loop_lag_seconds histogram: p50 and p99 interpolated within
its buckets, the max as the upper bound of the highest bucket reached).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvferry.common.errors import KvferryError
from kvferry.tools.bench.report import say
from kvferry.tools.bench.synthetic.model_folder import prepare_model_folder
from kvferry.tools.bench.synthetic.stack import SyntheticStack, child_setup, synthetic_stack

NEVER_MATCHES = "<|kvferry never matches|>"  # a stop string no cycle word starts: the detokenizer holds nothing back
WARMUP_STREAMS, WARMUP_TOKENS = 8, 16
LAG_METRIC = "kvferry:gateway_event_loop_lag_seconds"
PROFILE_TOP = 15


# -- figures of a process --------------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, every thread's, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lag_buckets(url: str) -> list[tuple[float, float]]:
    """The gateway's loop-lag histogram now: (upper bound, cumulative count) per bucket, +Inf last."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == LAG_METRIC:
            return [(float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket")]
    raise KvferryError(f"the gateway at {url} has no {LAG_METRIC} metric")


def lag_figures(before: list, after: list) -> dict:
    """p50, p99 (linear within a bucket, as Prometheus' histogram_quantile) and max (the highest bucket reached's
    bound) of the wake-ups between two readings, in ms."""
    bounds = [b for b, _ in after]
    counts = [a - b for (_, a), (_, b) in zip(after, before)]
    total = counts[-1]
    figures = {"loop_lag_samples": int(total)}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        figures[f"loop_lag_{name}_ms"] = None if not total else round(1000 * _quantile(bounds, counts, q), 3)
    reached = next((i for i, c in enumerate(counts) if c == total), len(counts) - 1)
    figures["loop_lag_max_ms"] = None if not total else round(1000 * bounds[reached], 3)
    return figures


def _quantile(bounds: list[float], counts: list[float], q: float) -> float:
    rank = q * counts[-1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-9)
        lower_bound, lower_count = bound, count
    return lower_bound


# -- one run -----------------------------------------------------------------------------------------------------
def run_load(stack: SyntheticStack, streams: int, tokens: int, clients: int, cpus: set[int] | None) -> dict:
    """streams spread over client processes, started together once every process's CPU is read; the figures."""
    shares = [streams // clients + (i < streams % clients) for i in range(clients)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvferry.tools.bench.sse_load", "127.0.0.1", str(stack.port), str(n), str(tokens)]
            + [NEVER_MATCHES],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=child_setup(cpus),
        )
        for n in shares
        if n
    ]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise KvferryError("a client process did not start")
        lag_before = lag_buckets(stack.url)
        workers = {"gateway": stack.gateway.pid, "decode": stack.decode.pid, "prefill": stack.prefill.pid}
        cpu_before = {name: cpu_s(pid) for name, pid in workers.items()}
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(proc.stdout.readline()) for proc in procs]
        cpu_after = {name: cpu_s(pid) for name, pid in workers.items()}
        lag_after = lag_buckets(stack.url)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    failures = [f for r in results for f in r["failures"]]
    if failures:
        num = sum(r["num_failures"] for r in results)
        raise KvferryError(f"{num} of {streams} streams failed; the first: {failures[0]}\n{stack.logs()}")
    elapsed = max(r["ended"] for r in results) - min(r["started"] for r in results)
    total = sum(r["tokens"] for r in results)
    per_token = {name: (cpu_after[name] - cpu_before[name]) / total for name in workers}
    return {
        "streams": streams,
        "tokens_each": tokens,
        "tokens": total,
        "elapsed_s": round(elapsed, 3),
        "tok_per_s": round(total / elapsed, 1),
        "gateway_cpu_us_per_token": round(per_token["gateway"] * 1e6, 1),
        # What one core of the gateway's would stream were it the gateway's alone: the figure that a neighbour on
        # the gateway's core (a shared machine) does not move.
        "tok_per_gateway_cpu_s": round(1 / per_token["gateway"], 1) if per_token["gateway"] else None,
        "gateway_core_busy": round((cpu_after["gateway"] - cpu_before["gateway"]) / elapsed, 3),
        "decode_cpu_us_per_token": round(per_token["decode"] * 1e6, 1),
        "prefill_cpu_us_per_token": round(per_token["prefill"] * 1e6, 1),
        "client_cpu_us_per_token": round(sum(r["cpu_s"] for r in results) / total * 1e6, 1),
        **lag_figures(lag_before, lag_after),
    }


# -- the profile -----------------------------------------------------------------------------------------------
def start_profile(pid: int, out: str, cpus: set[int] | None) -> subprocess.Popen:
    spy = Path(sys.executable).with_name("py-spy")
    command = [str(spy) if spy.exists() else "py-spy", "record", "--pid", str(pid), "--rate", "200"]
    # --gil: only what holds the interpreter (idle threads of a pool would count otherwise). Blocking (the gateway
    # paused for each sample): read without pausing, a third of the stacks came out cut short.
    command += ["--gil", "--format", "raw", "--output", out]
    try:
        proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=child_setup(cpus)
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
    cumulative list leaves out the frames on (nearly) every sample of their thread (runpy, the event loop's
    run_forever...), which say nothing."""
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
    telling = {f: n for f, n in anywhere.items() if n < 0.99 * per_root[root_of[f]]}

    def ranked(counts: dict) -> list:
        best = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]
        return [[name, round(n / max(total, 1), 4)] for name, n in best]

    return {"samples": total, "self": ranked(own), "cumulative": ranked(telling)}


def _function(frame: str) -> str:
    """`name (path/to/file.py:123)` -> `name (file.py)`: one function, whatever its line."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rpartition(":")[0] or where.rstrip(")")
    return f"{name} ({'/'.join(path.split('/')[-2:])})"


# -- the command -------------------------------------------------------------------------------------------------
def cmd_bench_gateway(args) -> int:
    if args.tokens < 2 or args.repeat < 1 or args.clients < 1:
        raise KvferryError("--tokens must be at least 2, --repeat and --clients at least 1")
    cpus = sorted(os.sched_getaffinity(0))
    pinned = not args.no_pin and len(cpus) >= 2
    gateway_cpus, other_cpus = ({cpus[0]}, set(cpus[1:])) if pinned else (None, None)
    if pinned:
        os.sched_setaffinity(0, other_cpus)  # this process waits, mostly; off the gateway's core all the same
    report = {"pinned": pinned, "gateway_cpus": sorted(gateway_cpus or cpus), "runs": []}
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-gateway-") as tmp:
        folder = prepare_model_folder(tmp)
        with synthetic_stack(folder, Path(tmp), gateway_cpus, other_cpus, args.step_interval) as stack:
            run_load(stack, WARMUP_STREAMS, WARMUP_TOKENS, 1, other_cpus)
            spy = start_profile(stack.gateway.pid, args.profile, other_cpus) if args.profile else None
            try:
                for streams in args.streams:
                    runs = [run_load(stack, streams, args.tokens, args.clients, other_cpus) for _ in range(args.repeat)]
                    best = max(runs, key=lambda r: r["tok_per_s"])
                    best["all_tok_per_s"] = [r["tok_per_s"] for r in runs]
                    report["runs"].append(best)
                    say(args, f"{streams} streams", {"tok/s": best["tok_per_s"], "runs": best["all_tok_per_s"]})
            finally:
                if spy is not None:
                    stop_profile(spy)
    if args.profile:
        report["profile"] = {"file": args.profile, **profile_top(args.profile)}
    if args.json:
        print(json.dumps(report))
        return 0
    print_report(report, args)
    return 0


def print_report(report: dict, args) -> None:
    where = f"pinned to CPU {report['gateway_cpus'][0]}" if report["pinned"] else "not pinned"
    print(f"\n== the gateway alone ({where}), synthetic workers, {args.tokens} tokens a stream, best of {args.repeat}")
    print(
        f"{'streams':>8} {'tok/s':>9} {'gateway µs/tok':>15} {'tok/gateway-cpu-s':>18} {'core busy':>10} "
        f"{'decode µs/tok':>14} "
        f"{'client µs/tok':>14} {'loop lag p50/p99/max ms':>24}"
    )
    for r in report["runs"]:
        lag = f"{r['loop_lag_p50_ms']}/{r['loop_lag_p99_ms']}/<={r['loop_lag_max_ms']}"
        print(
            f"{r['streams']:>8} {r['tok_per_s']:>9} {r['gateway_cpu_us_per_token']:>15} "
            f"{r['tok_per_gateway_cpu_s']:>18} {r['gateway_core_busy']:>10.0%} {r['decode_cpu_us_per_token']:>14} {r['client_cpu_us_per_token']:>14} "
            f"{lag:>24}"
        )
    profile = report.get("profile")
    if profile:
        print(f"\ngateway profile ({profile['samples']} samples, py-spy; stacks in {profile['file']}):")
        for kind in ("self", "cumulative"):
            print(f"  top {PROFILE_TOP} {kind}:")
            for name, share in profile[kind]:
                print(f"    {share:>6.1%}  {name}")
