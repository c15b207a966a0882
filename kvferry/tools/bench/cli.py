"""`kvferry bench engine`: the std workloads through the in-process engine, against the floor and transformers."""

import json

from kvferry.common import settings
from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError
from kvferry.tools.bench import workload
from kvferry.tools.bench.report import say


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("engine", help="offline workload through the in-process engine")
    p.add_argument("--workload", default="std-32", choices=["std-32", "std-128"])
    p.add_argument(
        "--baseline",
        choices=["none", "hf"],
        default="none",
        help="hf: also run transformers' own continuous batching on the same workload",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the compute-floor measurement")
    p.add_argument("--no-paging", action="store_true", help="skip the paged-vs-contiguous decode step")
    p.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip the roofline (`bench step --measure roofline`, measured quickly)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="runs of the engine and of the floor, alternated; the best of each is reported",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    settings.add_arguments(p, settings.BENCH)
    p.set_defaults(func=cmd_bench_engine)

    p = bench.add_parser("serve", help="the workload over HTTP against a running stack, streaming")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the served model, for the floor and the baseline")
    p.add_argument("--workload", default="std-32", choices=workload.NAMES)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second; 0: all at once")
    p.add_argument(
        "--sweep-rates",
        type=_rates,
        default=None,
        metavar="R1,R2,...",
        help="replay once at each rate instead: TTFT and TPOT p50/p99 against the rate",
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="with --sweep-rates: draw the curve")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument(
        "--baseline-url",
        default=None,
        metavar="URL",
        help="another OpenAI-compatible server (llama.cpp's, vLLM): the same workload, alternating rounds",
    )
    p.add_argument("--no-floor", action="store_true")
    p.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip the roofline (`bench step --measure roofline`, measured quickly)",
    )
    p.add_argument("--repeat", type=int, default=2, help="runs of the workload and of the floor, alternated")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the floor and the baseline")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_serve)

    from kvferry.tools.bench import ab, measure_parsers, quantization, sim_check

    measure_parsers.add_parsers(bench)
    sim_check.add_parser(bench)
    ab.add_parser(bench)
    quantization.add_parser(bench)

    p = bench.add_parser("overload", help="Poisson arrivals at half and at twice the capacity: 429s, completions, TTFT")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals at each rate")
    p.add_argument("--max-waiting", type=int, default=16, help="the gateway's admission bound for the run")
    p.add_argument("--model", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_overload)

    p = bench.add_parser(
        "pathological",
        help="one request with the most text work the gateway allows (a long output, n choices, the longest stop "
        "strings), while a probe times /v1/models every 50 ms",
    )
    p.add_argument("--url", default=None, help="a running stack; without it a fresh one starts, with --model")
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--stops", type=int, default=None, help="stop strings (default: the most the default limits allow)")
    p.add_argument("--stop-length", type=int, default=None, help="characters in each (default: the longest allowed)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_pathological)


def cmd_bench_overload(args) -> int:
    from kvferry.tools.bench.overload import overload
    from kvferry.tools.bench.stack import fresh_stack

    with fresh_stack(args.model, {settings.env_name("max_waiting"): str(args.max_waiting)}) as (url, _):
        report = overload(url, args.duration)
    report["max_waiting"] = args.max_waiting
    if args.json:
        print(json.dumps(report))
    else:
        print(f"capacity {report['capacity_per_s']} requests/s (32 sent at once); --max-waiting {args.max_waiting}")
        for label in ("half", "double"):
            r = report[label]
            print(
                f"at {r['rate_per_s']}/s ({label}): sent {r['sent']}, completed {r['completed']}, 429 "
                f"{r['refused_429']} (answered in p99 {r['refusal_answered_p99_ms']} ms, Retry-After on all: "
                f"{r['retry_after_on_every_429']}), errors {r['errors']}; TTFT p50/p99/max {r['ttft_p50_s']}/"
                f"{r['ttft_p99_s']}/{r['ttft_max_s']} s"
            )
    return 0


def cmd_bench_pathological(args) -> int:
    from kvferry.tools.bench.pathological import default_stops, pathological
    from kvferry.tools.bench.stack import fresh_stack

    count, length = default_stops()
    stops = (args.stops or count, args.stop_length or length)
    if args.url:
        report = pathological(args.url, args.max_tokens, args.n, *stops)
    else:
        with fresh_stack(args.model) as (url, _):
            report = pathological(url, args.max_tokens, args.n, *stops)
    if args.json:
        print(json.dumps(report))
        return 0
    r, idle, busy = report["request"], report["probe_idle"], report["probe_during_request"]
    print(
        f"request: max_tokens {r['max_tokens']}, n {r['n']}, {r['stop_strings']} stop strings of {r['stop_length']} "
        f"characters: {r['duration_s']} s, {r['output_tokens']} tokens in {r['chunks']} chunks, {r['finish_reasons']}"
    )
    for label, p in (("idle", idle), ("during the request", busy)):
        print(
            f"/v1/models {label}: {p['probes']} probes, p50 {p['p50_ms']} ms, p99 {p['p99_ms']} ms, max {p['max_ms']} ms"
        )
    return 0


def cmd_bench_engine(args) -> int:
    import torch

    from kvferry.common.engine import LLMEngine
    from kvferry.common.model_files import resolve_model
    from kvferry.tools.bench import hf_baseline
    from kvferry.tools.bench.offline import run_engine

    config = EngineConfig.from_args(args)
    config.num_threads = config.num_threads or 2
    engine = LLMEngine(config)
    requests = workload.generate(args.workload, engine.vocab_size)
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    if longest > engine.max_model_len:
        raise ConfigError(f"{args.workload} needs max_model_len >= {longest}, the engine has {engine.max_model_len}")
    report = {"workload": args.workload, "threads": torch.get_num_threads()}
    hf_model = hf_baseline.load_hf_model(engine) if not args.no_floor or args.baseline == "hf" else None
    engine.generate([workload.warmup_prompt(engine.vocab_size)], None)  # warm-up: first-call allocations
    _alternate_with_floor(
        args,
        "kvferry",
        lambda rnd: run_engine(engine, workload.for_round(requests, rnd, engine.vocab_size)),
        hf_model,
        requests,
        report,
    )
    if not args.no_roofline:
        _roofline(args, resolve_model(config.model), engine.device, engine.dtype, requests, report)
    if not args.no_paging:
        from kvferry.tools.bench.paging import paging_overhead

        report["paging"] = paging_overhead(engine)
        say(args, "paging overhead", report["paging"])
    if args.baseline == "hf":
        _hf_baseline(args, hf_model, requests, report)
    if args.json:
        print(json.dumps(report))
    else:
        _summary(report)
    return 0


def cmd_bench_serve(args) -> int:
    import asyncio

    import torch

    from kvferry.common.model_config import ModelConfig
    from kvferry.common.model_files import resolve_model
    from kvferry.tools.bench import hf_baseline
    from kvferry.tools.bench.serve import counters_delta, prefill_counters, replay, served_quantization
    from kvferry.tools.bench.stack import served_model

    torch.set_num_threads(args.threads)
    model_name = served_model(args.url)
    model_dir = resolve_model(args.model)
    vocab_size = ModelConfig.load(model_dir).vocab_size
    if args.sweep_rates:
        return _sweep(args, model_name, vocab_size)
    requests = workload.generate(args.workload, vocab_size, rate=args.rate)
    report = {"workload": args.workload, "rate": args.rate, "url": args.url}
    hf_model = hf_baseline.load_hf_model_dir(model_dir) if not args.no_floor or args.baseline == "hf" else None
    warmup = workload.generate("std-32", vocab_size, seed=99)[:2]  # shares no prefix with the workload
    asyncio.run(replay(args.url, model_name, warmup))
    if args.baseline_url:
        baseline_model = served_model(args.baseline_url)
        asyncio.run(replay(args.baseline_url, baseline_model, warmup))

        def baseline_once(rnd: int) -> dict:
            return asyncio.run(replay(args.baseline_url, baseline_model, workload.for_round(requests, rnd, vocab_size)))
    else:
        baseline_once = None
    before = prefill_counters(args.url)  # kvferry's own counters; other servers have none
    _alternate_with_floor(
        args,
        "serve",
        lambda rnd: asyncio.run(replay(args.url, model_name, workload.for_round(requests, rnd, vocab_size))),
        hf_model,
        requests,
        report,
        baseline_once,
    )
    if not args.no_roofline:
        from kvferry.common.engine_setup import resolve_device, resolve_dtype

        device = resolve_device(settings.from_env("device"))  # as the floor's model: a stack started here runs there
        args.quantization = served_quantization(args.url)  # the roofline of the weights the stack reads
        _roofline(args, model_dir, device, resolve_dtype(settings.from_env("dtype"), device), requests, report)
    report["prefill_all_runs"] = counters_delta(
        before, prefill_counters(args.url, (before or {}).get("prompts_prefilled", 0) + args.repeat * len(requests))
    )
    # One 512-token prompt alone: its KV transfer against the time it took to reach decode.
    prompt_512 = [t for r in requests for t in r["prompt_token_ids"]][:512]
    probe = asyncio.run(
        replay(
            args.url,
            model_name,
            [{"id": "probe-512", "prompt_token_ids": prompt_512, "max_tokens": 2, "arrival_s": 0.0}],
        )
    )
    report["probe_512"] = {
        "ttft_s": probe["ttft_p50_s"],
        "kv_transfer_ms": probe["kv_transfer_p50_ms"],
        "transfer_share": round(probe["kv_transfer_p50_ms"] / 1000 / probe["ttft_p50_s"], 4),
    }
    say(args, "512-token prompt", report["probe_512"])
    if args.baseline == "hf":
        _hf_baseline(args, hf_model, requests, report)
    if args.json:
        print(json.dumps(report))
    else:
        k = report["kvferry"]
        print(f"\n== {args.workload} over HTTP at {args.url} (rate {args.rate or 'all at once'}) ==")
        print(
            f"output tok/s {k['output_tok_per_s']}, requests/s {k['requests_per_s']} ({k['elapsed_s']} s; runs "
            f"{k['runs_s']} s)"
        )
        print(
            f"TTFT p50/p99 {k['ttft_p50_s']}/{k['ttft_p99_s']} s, TPOT p50/p99 {k['tpot_p50_ms']}/{k['tpot_p99_ms']} "
            f"ms, KV transfer per request p50/p99 {k['kv_transfer_p50_ms']}/{k['kv_transfer_p99_ms']} ms"
        )
        for g, figures in k.get("groups", {}).items():
            print(f"{g} prompts: TTFT p50/p99 {figures['ttft_p50_s']}/{figures['ttft_p99_s']} s")
        if report["prefill_all_runs"]:
            c = report["prefill_all_runs"]
            print(
                f"prefill workers over the {args.repeat} runs: {c['prompts_prefilled']} prompts, "
                f"{c['prompt_tokens_computed']} prompt tokens computed, {c['prompt_tokens_cached']} from the cache "
                f"({c['cached_share']:.1%}); KV shipped {c['kv_bytes_sent'] / 2**20:.0f} MiB, "
                f"{c['kv_bytes_skipped'] / 2**20:.0f} MiB left out as held by decode ({c['kv_bytes_saved_share']:.1%})"
            )
        if "floor" in report:
            f = report["floor"]
            print(
                f"compute floor {f['floor_output_tok_per_s']} tok/s ({f['floor_s']} s): the stack reaches "
                f"{k['fraction_of_floor']:.0%} of it"
            )
        _roofline_line(report)
        if "baseline" in report:
            b = report["baseline"]
            extra = f", {b['fraction_of_floor']:.0%} of the floor" if "fraction_of_floor" in b else ""
            print(
                f"baseline {args.baseline_url}: {b['output_tok_per_s']} tok/s (runs {b['runs_s']} s; TTFT p50/p99 "
                f"{b['ttft_p50_s']}/{b['ttft_p99_s']} s, TPOT p50/p99 {b['tpot_p50_ms']}/{b['tpot_p99_ms']} ms{extra}); "
                f"the stack is {k['speedup_vs_baseline']}x"
            )
        pr = report["probe_512"]
        print(
            f"512-token prompt: {pr['ttft_s']} s to its first token, KV transfer {pr['kv_transfer_ms']} ms "
            f"(+{pr['transfer_share']:.1%} on its way to decode)"
        )
        if "hf" in report:
            print(
                f"transformers CB {report['hf']['output_tok_per_s']} tok/s: kvferry is {report['hf']['kvferry_speedup']}x"
            )
    return 0


def _rates(text: str) -> list[float]:
    import argparse

    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r} (try 0.5,1,2,4)") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive requests per second, got {text!r}")
    return rates


def _sweep(args, model_name: str, vocab_size: int) -> int:
    import asyncio

    from kvferry.tools.bench import sweep
    from kvferry.tools.bench.serve import replay

    asyncio.run(replay(args.url, model_name, workload.generate("std-32", vocab_size, seed=99)[:2]))  # warm-up
    points = sweep.sweep(
        args.url,
        model_name,
        lambda rate, seed: workload.generate(args.workload, vocab_size, rate=rate, seed=seed),
        args.sweep_rates,
    )
    if args.plot:
        sweep.plot(points, f"{args.workload} at {args.url}", args.plot)
    if args.json:
        print(json.dumps({"workload": args.workload, "url": args.url, "points": points}))
        return 0
    print(f"\n== {args.workload} over HTTP at {args.url}, one replay per rate ==")
    print(f"{'rate/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
    for pt in points:
        print(
            f"{pt['rate']:>7} {pt['output_tok_per_s']:>7} {pt['ttft_p50_s']:>8}s {pt['ttft_p99_s']:>8}s "
            f"{pt['tpot_p50_ms']:>7}ms {pt['tpot_p99_ms']:>7}ms"
        )
    if args.plot:
        print(f"curve drawn to {args.plot}")
    return 0


def _alternate_with_floor(
    args, label: str, run_once, hf_model, requests: list[dict], report: dict, baseline_once=None
) -> None:
    """Run the workload (and baseline_once, another server, when given) and measure the floor in alternation,
    keeping the best of each: on a shared machine a slow spell then hits every side rather than one.
    run_once(round) replays workload.for_round's requests: a later round must not find the earlier rounds'
    prompts in the prefix cache."""
    from kvferry.tools.bench.floor import measure_floor

    runs, floors, baselines = [], [], []
    for i in range(args.repeat):
        runs.append(run_once(i))
        say(args, f"{label} run {i + 1}", runs[-1])
        if baseline_once is not None:
            baselines.append(baseline_once(i))
            say(args, f"baseline run {i + 1}", baselines[-1])
        if not args.no_floor:
            floors.append(measure_floor(hf_model, requests))
            say(args, f"floor run {i + 1}", floors[-1])
    report["kvferry"] = dict(min(runs, key=lambda r: r["elapsed_s"]), runs_s=[r["elapsed_s"] for r in runs])
    if floors:
        report["floor"] = dict(min(floors, key=lambda f: f["floor_s"]), runs_s=[f["floor_s"] for f in floors])
        report["kvferry"]["fraction_of_floor"] = round(report["floor"]["floor_s"] / report["kvferry"]["elapsed_s"], 3)
    if baselines:
        best = report["baseline"] = dict(
            min(baselines, key=lambda r: r["elapsed_s"]), runs_s=[r["elapsed_s"] for r in baselines]
        )
        report["kvferry"]["speedup_vs_baseline"] = round(best["elapsed_s"] / report["kvferry"]["elapsed_s"], 3)
        if floors:
            best["fraction_of_floor"] = round(report["floor"]["floor_s"] / best["elapsed_s"], 3)


def _roofline(args, model_dir, device, dtype, requests: list[dict], report: dict) -> None:
    """`bench step --measure roofline`'s figure for the workload, measured quickly, and kvferry's share of it."""
    from kvferry.tools.bench.roofline_measure import quantization_of, quick_roofline

    r = report["roofline"] = quick_roofline(model_dir, device, dtype, requests, quantization=quantization_of(args))
    if "total_s" in r:
        report["kvferry"]["fraction_of_roofline"] = round(r["total_s"] / report["kvferry"]["elapsed_s"], 3)
    say(args, "roofline", r)


def _hf_baseline(args, hf_model, requests: list[dict], report: dict) -> None:
    from kvferry.tools.bench.hf_baseline import run_hf_continuous_batching

    hf = report["hf"] = run_hf_continuous_batching(hf_model, requests)
    hf["kvferry_speedup"] = round(report["kvferry"]["output_tok_per_s"] / hf["output_tok_per_s"], 2)
    if "floor" in report:
        hf["fraction_of_floor"] = round(report["floor"]["floor_s"] / hf["elapsed_s"], 3)
    say(args, "transformers continuous batching", hf)


def _summary(report: dict) -> None:
    k = report["kvferry"]
    print(f"\n== {report['workload']} on {report['threads']} threads ==")
    print(
        f"kvferry output tok/s        {k['output_tok_per_s']:>10}   ({k['elapsed_s']} s, {k['output_tokens']} tokens; "
        f"runs {k['runs_s']} s; TTFT p50/p99 {k['ttft_p50_s']}/{k['ttft_p99_s']} s, "
        f"TPOT p50/p99 {k['tpot_p50_ms']}/{k['tpot_p99_ms']} ms)"
    )
    if "floor" in report:
        f = report["floor"]
        print(
            f"compute floor               {f['floor_output_tok_per_s']:>10}   ({f['floor_s']} s; runs {f['runs_s']} s)   "
            f"kvferry reaches {k['fraction_of_floor']:.0%} of it"
        )
    _roofline_line(report)
    if "hf" in report:
        h = report["hf"]
        extra = f", {h['fraction_of_floor']:.0%} of floor" if "fraction_of_floor" in h else ""
        print(
            f"transformers CB tok/s       {h['output_tok_per_s']:>10}   ({h['elapsed_s']} s{extra})   "
            f"kvferry is {h['kvferry_speedup']}x"
        )
    if "paging" in report:
        from kvferry.tools.bench.paging import text

        print(text(report["paging"]))


def _roofline_line(report: dict) -> None:
    r = report.get("roofline")
    if r is None:
        return
    if "total_s" not in r:
        print(f"roofline                    cannot compute: {r['cannot_compute']}")
        return
    print(
        f"roofline                    {r['output_tok_per_s']:>10}   ({r['total_s']} s, {r['limits_used']}; "
        f"`kvferry bench step --measure roofline` for its figures)   kvferry reaches {report['kvferry']['fraction_of_roofline']:.0%} of it"
    )
