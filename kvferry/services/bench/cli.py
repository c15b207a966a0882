"""`kvferry bench engine`: the std workloads through the in-process engine, against the floor and transformers."""
import json
import sys

from kvferry.common.config import EngineConfig


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("engine", help="offline workload through the in-process engine")
    p.add_argument("--workload", default="std-32", choices=["std-32", "std-128"])
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="hf: also run transformers' own continuous batching on the same workload")
    p.add_argument("--no-floor", action="store_true", help="skip the compute-floor measurement")
    p.add_argument("--no-paging", action="store_true", help="skip the paged-vs-contiguous decode step")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    EngineConfig.add_args(p)
    p.set_defaults(func=cmd_bench_engine)


def cmd_bench_engine(args) -> int:
    import torch

    from kvferry.common.engine import LLMEngine
    from kvferry.services.bench import workload
    from kvferry.services.bench.offline import run_engine

    config = EngineConfig.from_args(args)
    config.num_threads = config.num_threads or 2
    engine = LLMEngine(config)
    requests = workload.generate(args.workload, engine.vocab_size)
    report = {"workload": args.workload, "threads": torch.get_num_threads()}
    engine.generate([requests[0]["prompt_token_ids"]], None)  # warm-up: first-call allocations
    report["kvferry"] = run_engine(engine, requests)
    _say(args, "kvferry", report["kvferry"])
    if not args.no_paging:
        from kvferry.services.bench.paging import paging_overhead

        report["paging"] = paging_overhead(engine)
        _say(args, "paging overhead", report["paging"])
    if not args.no_floor or args.baseline == "hf":
        hf_model = _load_hf_model(engine)
        if not args.no_floor:
            from kvferry.services.bench.floor import measure_floor

            report["floor"] = measure_floor(hf_model, requests)
            report["kvferry"]["fraction_of_floor"] = round(report["floor"]["floor_s"] / report["kvferry"]["elapsed_s"], 3)
            _say(args, "floor", report["floor"])
        if args.baseline == "hf":
            from kvferry.services.bench.hf_baseline import run_hf_continuous_batching

            report["hf"] = run_hf_continuous_batching(hf_model, requests)
            report["hf"]["kvferry_speedup"] = round(report["kvferry"]["output_tok_per_s"] / report["hf"]["output_tok_per_s"], 2)
            if "floor" in report:
                report["hf"]["fraction_of_floor"] = round(report["floor"]["floor_s"] / report["hf"]["elapsed_s"], 3)
            _say(args, "transformers continuous batching", report["hf"])
    if args.json:
        print(json.dumps(report))
    else:
        _summary(report)
    return 0


def _load_hf_model(engine):
    import torch
    from transformers import AutoModelForCausalLM

    from kvferry.common.model.loader import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model(engine.config.model), dtype=torch.float32).eval()


def _say(args, title: str, figures: dict) -> None:
    if not args.json:
        print(f"{title}: " + ", ".join(f"{k}={v}" for k, v in figures.items() if k != "step_ms"), file=sys.stderr)


def _summary(report: dict) -> None:
    k = report["kvferry"]
    print(f"\n== {report['workload']} on {report['threads']} threads ==")
    print(f"kvferry output tok/s        {k['output_tok_per_s']:>10}   ({k['elapsed_s']} s, {k['output_tokens']} tokens)")
    if "floor" in report:
        f = report["floor"]
        print(f"compute floor               {f['floor_output_tok_per_s']:>10}   ({f['floor_s']} s)   "
              f"kvferry reaches {k['fraction_of_floor']:.0%} of it")
    if "hf" in report:
        h = report["hf"]
        extra = f", {h['fraction_of_floor']:.0%} of floor" if "fraction_of_floor" in h else ""
        print(f"transformers CB tok/s       {h['output_tok_per_s']:>10}   ({h['elapsed_s']} s{extra})   "
              f"kvferry is {h['kvferry_speedup']}x")
    if "paging" in report:
        p = report["paging"]
        print(f"paging overhead             {p['overhead']:>10}x  (decode step, batch {p['batch']}, context "
              f"{p['context']}: paged {p['paged_step_ms']} ms, preallocated contiguous {p['contiguous_step_ms']} ms)")
        print(f"  vs a growing cache        {p['overhead_vs_growing']:>10}x  (contiguous, concatenated each step as "
              f"transformers' default cache: {p['growing_step_ms']} ms)")
