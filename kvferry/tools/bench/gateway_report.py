"""`kvferry bench gateway`'s report: per stream count and gateway count, the fastest round's figures (a table as
before) and the rounds pooled (CPU per token over all their tokens, each gateway's share of all their streams), and
each gateway count's CPU per token against the first count's, pooled and round by round."""

from kvferry.services.gateway.metrics import LOOP_LAG_BUCKETS
from kvferry.tools.bench.gateway_profile import PROFILE_TOP, PROFILED
from kvferry.tools.bench.synthetic.double import SEND_TIMEOUT_MS

BALANCE_BAND = 0.10  # a share within 1/N ± this of the streams counts as even (2 gateways: 40 to 60%)


def pool_runs(runs: list[dict]) -> dict:
    """One stream count at one gateway count over its rounds: the fastest run, with the pooled figures beside it."""
    best = dict(max(runs, key=lambda r: r["tok_per_s"]))
    best["all_tok_per_s"] = [r["tok_per_s"] for r in runs]
    ids = [g["id"] for g in runs[0]["per_gateway"]]
    served = {gid: sum(g["streams"] for r in runs for g in r["per_gateway"] if g["id"] == gid) for gid in ids}
    cpu = {gid: sum(g["cpu_s"] for r in runs for g in r["per_gateway"] if g["id"] == gid) for gid in ids}
    counted = sum(served.values())
    best["pooled"] = {
        "rounds": len(runs),
        "gateway_cpu_us_per_token": round(sum(cpu.values()) / sum(r["tokens"] for r in runs) * 1e6, 1),
        "per_round_gateway_cpu_us_per_token": [r["gateway_cpu_us_per_token"] for r in runs],
        "shares": {gid: round(served[gid] / counted, 4) if counted else None for gid in ids},
        "per_round_shares": [[g["share"] for g in r["per_gateway"]] for r in runs],
        "rounds_balanced": sum(balanced([g["share"] for g in r["per_gateway"]]) for r in runs),
        "per_process_cpu_us_per_token": {
            gid: round(cpu[gid] / (served[gid] * best["tokens_each"]) * 1e6, 1) if served[gid] else None for gid in ids
        },
    }
    return best


def balanced(shares: list) -> bool:
    """Every share within 1/N ± BALANCE_BAND."""
    return all(s is not None and abs(s - 1 / len(shares)) <= BALANCE_BAND + 1e-9 for s in shares)


def comparisons(runs: list[dict], counts: list[int]) -> list[dict]:
    """Each gateway count's CPU per token (summed over its processes) against the first count's at the same stream
    count: over all rounds' tokens, and round by round (rounds alternate, so round r of each ran side by side)."""
    pooled = {(r["streams"], r["gateways"]): r["pooled"] for r in runs}
    found = []
    for streams in dict.fromkeys(r["streams"] for r in runs):
        base = pooled[(streams, counts[0])]
        for n in counts[1:]:
            other = pooled[(streams, n)]
            rounds = zip(other["per_round_gateway_cpu_us_per_token"], base["per_round_gateway_cpu_us_per_token"])
            found.append(
                {
                    "streams": streams,
                    "gateways": n,
                    "against": counts[0],
                    "cpu_per_token_ratio": round(
                        other["gateway_cpu_us_per_token"] / base["gateway_cpu_us_per_token"], 3
                    ),
                    "per_round_ratios": [round(a / b, 3) for a, b in rounds],
                    "shares": list(other["shares"].values()),
                    "rounds_balanced": other["rounds_balanced"],
                    "rounds": other["rounds"],
                }
            )
    return found


def print_report(report: dict, args) -> None:
    if report["pinned"]:
        cpus = report["gateway_cpus"]
        where = f"pinned to CPU {cpus[0]}" if len(cpus) == 1 else f"pinned to CPUs {','.join(map(str, cpus))}"
    elif max(report["gateway_counts"]) >= report["num_cpus"] and not args.no_pin:
        where = f"not pinned: {max(report['gateway_counts'])} gateways and the rest on {report['num_cpus']} cores"
    else:
        where = "not pinned"
    print(
        f"\n== the gateway alone ({where}), synthetic workers, {args.tokens} tokens a stream, best of "
        f"{report['rounds']} round(s)"
    )
    if report["profiled"]:
        print(f"   {PROFILED}")
    print(
        f"{'streams':>8} {'gateways':>8} {'tok/s':>9} {'gateway µs/tok':>15} {'tok/gateway-cpu-s':>18} "
        f"{'cores busy':>10} {'decode µs/tok':>14} {'client µs/tok':>14} {'loop lag p50/p99/max ms':>24} "
        f"{'sends waited':>12}  shares"
    )
    for r in report["runs"]:
        top = f">{LOOP_LAG_BUCKETS[-1] * 1000:g}" if r["loop_lag_past_top_bucket"] else f"<={r['loop_lag_max_ms']}"
        lag = f"{r['loop_lag_p50_ms']}/{r['loop_lag_p99_ms']}/{top}"
        shares = "/".join(f"{g['share']:.0%}" for g in r["per_gateway"]) if r["gateways"] > 1 else "-"
        print(
            f"{r['streams']:>8} {r['gateways']:>8} {r['tok_per_s']:>9} {r['gateway_cpu_us_per_token']:>15} "
            f"{r['tok_per_gateway_cpu_s']:>18} {r['gateway_cores_busy']:>10.0%} {r['decode_cpu_us_per_token']:>14} "
            f"{r['client_cpu_us_per_token']:>14} {lag:>24} {r['decode_sends_waited_share']:>12.1%}  {shares}"
        )
    if not args.step_interval:
        print(
            "  saturated (--step-interval 0): the loop lag is a loop that always finds a message waiting; a paced run "
            "(--step-interval)\n  gives the lag a gateway at a real pace adds"
        )
    if any(r["decode_sends_waited"] or r["prefill_sends_waited"] for r in report["runs"]):
        print(
            "  sends waited: the decode double's sends that found the queue to the gateway full and waited for room, "
            "where a real worker\n  drops them: backpressure a real stack does not have"
        )
    unsent = sum(r["sends_unsent"] for r in report["runs"])
    if unsent:
        print(f"  {unsent} sends of the doubles found no room in {SEND_TIMEOUT_MS} ms and were dropped")
    if report["comparisons"]:
        print(
            f"\nagainst {report['gateway_counts'][0]} gateway(s), over all {report['rounds']} rounds (gateway CPU per "
            "token summed over the processes; shares: the streams each process served)"
        )
    pooled = {(r["streams"], r["gateways"]): r["pooled"] for r in report["runs"]}
    for c in report["comparisons"]:
        p, base = pooled[(c["streams"], c["gateways"])], pooled[(c["streams"], c["against"])]
        per_process = "/".join(f"{v}" for v in p["per_process_cpu_us_per_token"].values())
        print(
            f"  {c['streams']} streams, {c['gateways']} gateways: CPU per token x{c['cpu_per_token_ratio']} "
            f"({p['gateway_cpu_us_per_token']} against {base['gateway_cpu_us_per_token']} µs;"
            f" rounds {', '.join(f'x{x}' for x in c['per_round_ratios'])}); per process {per_process} µs; shares "
            f"{'/'.join(f'{s:.1%}' for s in c['shares'])}, each within {1 / c['gateways']:.0%} ± "
            f"{BALANCE_BAND:.0%} in {c['rounds_balanced']} of {c['rounds']} rounds"
        )
    profile = report.get("profile")
    if profile:
        print(f"\ngateway profile ({profile['samples']} samples, py-spy; stacks in {profile['file']}):")
        for kind in ("self", "cumulative"):
            print(f"  top {PROFILE_TOP} {kind}:")
            for name, share in profile[kind]:
                print(f"    {share:>6.1%}  {name}")
