"""`kvferry bench gateway`: the serving path alone. The real gateway (one process, pinned to one core; or with
--gateways N, the group of N processes on one port that `kvferry gateway --gateways N` starts) serves synthetic
workers (TEST DOUBLES, bench/synthetic/) that cost nothing per token but their messages, and a cheap raw client
(bench/sse_load.py, on the other cores with the doubles) streams chat completions at once, each of --tokens tokens
with ignore_eos and a stop string that never matches, so that detokenization and the stop-string check run.

Per stream count (and gateway count) it reports the streamed tokens per second, each process's CPU seconds per token
over the load (/proc/PID/stat for the gateways and the doubles, the client's own process time; the gateways' summed
over their processes), the gateways' event-loop lag over the load (bench/gateway_metrics.py), and which share of
the streams each gateway process served (its finished requests, read from its /metrics before and after).

Several gateway counts (--gateways 1,2) run side by side, each its own stack, in alternated rounds (every stream
count at every gateway count per round, the order reversed each round), so that a drift of the shared machine falls
on each alike; gateway_report.py sets their CPU per token against the first count's.
"""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvferry.common.errors import KvferryError
from kvferry.common.gateway_config import MAX_GATEWAYS
from kvferry.services.launcher import child_setup
from kvferry.tools.bench.gateway_metrics import lag_figures, merged_lag, read_gateways
from kvferry.tools.bench.gateway_profile import profile_top, start_profile, stop_profile
from kvferry.tools.bench.gateway_report import comparisons, pool_runs, print_report
from kvferry.tools.bench.report import say
from kvferry.tools.bench.synthetic.model_folder import SYNTHETIC_MODEL_NAME, prepare_model_folder
from kvferry.tools.bench.synthetic.stack import SyntheticStack, synthetic_stack

NEVER_MATCHES = "<|kvferry never matches|>"  # a stop string no cycle word starts: the detokenizer holds nothing back
WARMUP_STREAMS, WARMUP_TOKENS = 8, 16  # the streams per gateway process


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, every thread's, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- one run -----------------------------------------------------------------------------------------------------
@dataclass
class Client:
    """A client process (bench/sse_load.py) and the file its stderr goes to, read back if it fails."""

    proc: subprocess.Popen
    stderr: IO[str]

    @classmethod
    def start(cls, stack: SyntheticStack, streams: int, tokens: int, cpus: set[int] | None) -> "Client":
        command = [sys.executable, "-m", "kvferry.tools.bench.sse_load", "127.0.0.1", str(stack.port), str(streams)]
        command += [str(tokens), NEVER_MATCHES, SYNTHETIC_MODEL_NAME]
        stderr = tempfile.TemporaryFile("w+")
        setup = child_setup(os.getpid(), cpus=cpus)
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=setup
        )
        return cls(proc, stderr)

    def line(self) -> str:
        """Its next line; one that ends without it (a crash) is an error that says so, with its stderr's end."""
        line = self.proc.stdout.readline()
        if line.endswith("\n"):
            return line
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.stderr.seek(0)
        said = self.stderr.read()[-2000:]
        raise KvferryError(f"a client process ended (exit status {self.proc.returncode}) before its figures:\n{said}")

    def figures(self) -> dict:
        line = self.line()
        try:
            return json.loads(line)
        except ValueError:
            raise KvferryError(f"a client process printed {line[:300]!r}, not its figures") from None

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.stderr.close()


def run_load(stack: SyntheticStack, streams: int, tokens: int, clients: int, cpus: set[int] | None) -> dict:
    """streams spread over client processes, started together once every process's CPU is read; the figures."""
    shares = [streams // clients + (i < streams % clients) for i in range(clients)]
    loads = [Client.start(stack, n, tokens, cpus) for n in shares if n]
    gateways = stack.gateways
    processes = {"decode": stack.decode.pid, "prefill": stack.prefill.pid, **gateways}
    if len(gateways) > 1:
        processes["supervisor"] = stack.gateway.pid  # the group's: it serves nothing, it waits on its children
    try:
        for client in loads:
            if (said := client.line()) != "ready\n":
                raise KvferryError(f"a client process said {said[:300]!r}, not ready")
        # Read before the CPU (and after it, below): a scrape's own cost stays out of the figures.
        before = read_gateways(stack.url, gateways)
        cpu_before = {name: cpu_s(pid) for name, pid in processes.items()}
        sends_before = stack.send_counts()
        for client in loads:
            client.go()
        results = [client.figures() for client in loads]
        cpu_after = {name: cpu_s(pid) for name, pid in processes.items()}
        sends_after = stack.send_counts()
        after = read_gateways(stack.url, gateways)
    finally:
        for client in loads:
            client.close()
    failures = [f for r in results for f in r["failures"]]
    if failures:
        num = sum(r["num_failures"] for r in results)
        raise KvferryError(f"{num} of {streams} streams failed; the first: {failures[0]}\n{stack.logs()}")
    elapsed = max(r["ended"] for r in results) - min(r["started"] for r in results)
    total = sum(r["tokens"] for r in results)
    cpu = {name: cpu_after[name] - cpu_before[name] for name in processes}
    sends = {role: {k: n - sends_before[role][k] for k, n in counts.items()} for role, counts in sends_after.items()}
    gateway_cpu_s = sum(cpu[gid] for gid in gateways)
    per_gateway = []
    for gid, pid in gateways.items():
        served = round(after[gid].num_finished - before[gid].num_finished)
        per_token = cpu[gid] / (served * tokens) if served else None
        per_gateway.append(
            {
                "id": gid,
                "pid": pid,
                "streams": served,
                "cpu_s": round(cpu[gid], 4),
                # Its CPU over the tokens it streamed itself: what one process costs per token.
                "cpu_us_per_token": round(per_token * 1e6, 1) if per_token is not None else None,
            }
        )
    counted = sum(g["streams"] for g in per_gateway)
    for g in per_gateway:
        g["share"] = round(g["streams"] / counted, 4) if counted else None
    run = {
        "streams": streams,
        "gateways": len(gateways),
        "tokens_each": tokens,
        "tokens": total,
        "elapsed_s": round(elapsed, 3),
        "tok_per_s": round(total / elapsed, 1),
        "gateway_cpu_s": round(gateway_cpu_s, 4),
        # Summed over the gateway processes: what the HTTP side costs per token, however many share it.
        "gateway_cpu_us_per_token": round(gateway_cpu_s / total * 1e6, 1),
        # What one core of the gateways' would stream were it theirs alone: the figure that a neighbour on the
        # gateways' cores (a shared machine) does not move.
        "tok_per_gateway_cpu_s": round(total / gateway_cpu_s, 1) if gateway_cpu_s else None,
        "gateway_cores_busy": round(gateway_cpu_s / elapsed, 3),
        "decode_cpu_us_per_token": round(cpu["decode"] / total * 1e6, 1),
        "prefill_cpu_us_per_token": round(cpu["prefill"] / total * 1e6, 1),
        "client_cpu_us_per_token": round(sum(r["cpu_s"] for r in results) / total * 1e6, 1),
        "streams_counted": counted,  # by the gateways' own counters: the streams, when each one counted its own
        "per_gateway": per_gateway,
        **lag_figures(merged_lag(before.values()), merged_lag(after.values())),
        # The doubles' sends that found the queue to the gateway (or to the decode double) full and waited for
        # room: each one a message a real worker would have dropped (synthetic/double.py). Unsent: past the wait.
        "decode_sends": sends["decode"]["sent"],
        "decode_sends_waited": sends["decode"]["waited"],
        "decode_sends_waited_share": round(sends["decode"]["waited"] / max(sends["decode"]["sent"], 1), 4),
        "prefill_sends_waited": sends["prefill"]["waited"],
        "sends_unsent": sends["decode"]["unsent"] + sends["prefill"]["unsent"],
    }
    if "supervisor" in cpu:
        run["supervisor_cpu_us_per_token"] = round(cpu["supervisor"] / total * 1e6, 2)
    return run


# -- the command -------------------------------------------------------------------------------------------------
def cmd_bench_gateway(args) -> int:
    if args.tokens < 2 or args.repeat < 1 or args.clients < 1:
        raise KvferryError("--tokens must be at least 2, --repeat and --clients at least 1")
    counts = args.gateways
    if max(counts) > MAX_GATEWAYS or len(set(counts)) != len(counts):
        raise KvferryError(f"--gateways takes distinct counts from 1 to {MAX_GATEWAYS}, got {counts}")
    if args.profile and len(counts) > 1:
        raise KvferryError("--profile records one gateway process: give --gateways one count")
    cpus = sorted(os.sched_getaffinity(0))
    # The gateways pinned to cores of their own, as many as the largest group has processes, and everything else
    # to the cores left; every count alike, so that the rounds compare like with like. Where no core would be
    # left (2 gateways on 2 cores) nothing is pinned: N gateways on one core would share it, and the client and
    # the doubles on the gateways' cores would be no better.
    pinned = not args.no_pin and len(cpus) > max(counts)
    gateway_cpus, other_cpus = (set(cpus[: max(counts)]), set(cpus[max(counts) :])) if pinned else (None, None)
    if pinned:
        os.sched_setaffinity(0, other_cpus)  # this process waits, mostly; off the gateways' cores all the same
    report = {
        "pinned": pinned,
        "gateway_cpus": sorted(gateway_cpus or cpus),
        "num_cpus": len(cpus),
        "gateway_counts": counts,
        "rounds": args.repeat,
        "profiled": bool(args.profile),  # then every run's figures are a paused gateway's (gateway_profile.PROFILED)
        "runs": [],
    }
    runs = {(streams, n): [] for streams in args.streams for n in counts}
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-gateway-") as tmp, contextlib.ExitStack() as open_stacks:
        folder = prepare_model_folder(tmp)
        stacks = {}
        for n in counts:
            log_dir = Path(tmp) / f"gateways-{n}"
            log_dir.mkdir()
            stack = synthetic_stack(folder, log_dir, gateway_cpus, other_cpus, args.step_interval, num_gateways=n)
            stacks[n] = open_stacks.enter_context(stack)
            run_load(stacks[n], WARMUP_STREAMS * n, WARMUP_TOKENS, 1, other_cpus)
        first_gateway = next(iter(stacks[counts[0]].gateways.values()))
        spy = start_profile(first_gateway, args.profile, other_cpus) if args.profile else None
        try:
            for round_index in range(args.repeat):
                for streams in args.streams:
                    for n in counts if round_index % 2 == 0 else counts[::-1]:
                        run = run_load(stacks[n], streams, args.tokens, args.clients, other_cpus)
                        runs[(streams, n)].append(run)
                        shares = "/".join(f"{g['share']:.0%}" for g in run["per_gateway"]) if n > 1 else "-"
                        figures = {"tok/s": run["tok_per_s"], "gateway µs/tok": run["gateway_cpu_us_per_token"]}
                        profiled = " (profiled)" if args.profile else ""
                        say(
                            args,
                            f"round {round_index + 1}, {streams} streams, {n} gateway(s){profiled}",
                            {**figures, "shares": shares},
                        )
        finally:
            if spy is not None:
                stop_profile(spy)
    report["runs"] = [pool_runs(runs[key]) for key in runs]
    report["comparisons"] = comparisons(report["runs"], counts)
    if args.profile:
        report["profile"] = {"file": args.profile, **profile_top(args.profile)}
    if args.json:
        print(json.dumps(report, allow_nan=False))  # an inf or a NaN would be no JSON: a bug, said here
        return 0
    print_report(report, args)
    return 0
