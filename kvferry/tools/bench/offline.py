"""`kvferry bench engine`: a workload through the in-process engine, all requests at once, timed, against the
compute floor, the roofline and transformers."""

import json
import time

from kvferry.common.sampling import SamplingParams
from kvferry.tools.bench import workload
from kvferry.tools.percentiles import summary


def run_engine(engine, requests: list[dict]) -> dict:
    start = time.perf_counter()
    first_token_at, finished_at, num_out = {}, {}, {}
    for r in requests:
        engine.add_request(
            r["prompt_token_ids"],
            SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, **workload.sampling(r)),
            request_id=r["id"],
        )
    num_steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        num_steps += 1
        now = time.perf_counter() - start
        for out in outputs:
            first_token_at.setdefault(out.request_id, now)
            if out.finished:
                finished_at[out.request_id] = now
                num_out[out.request_id] = len(out.output_token_ids)
    elapsed = time.perf_counter() - start
    wrong = [r["id"] for r in requests if num_out.get(r["id"]) != r["max_tokens"]]
    assert not wrong, f"requests with the wrong output length: {wrong[:5]}"
    ttft = [first_token_at[r["id"]] for r in requests]
    tpot = [(finished_at[r["id"]] - first_token_at[r["id"]]) / max(1, r["max_tokens"] - 1) for r in requests]
    total_out = sum(num_out.values())
    return {
        "elapsed_s": round(elapsed, 2),
        "output_tokens": total_out,
        "output_tok_per_s": round(total_out / elapsed, 1),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "num_steps": num_steps,
        **summary(ttft, (50, 99), digits=3, key="ttft_{}_s"),
        **summary(tpot, (50, 99), 1000, 1, key="tpot_{}_ms"),
        "preemptions": engine.scheduler.num_preemptions,
    }


def cmd_bench_engine(args) -> int:
    import torch

    from kvferry.common.config import EngineConfig
    from kvferry.common.engine import LLMEngine
    from kvferry.common.errors import ConfigError
    from kvferry.common.model_files import resolve_model
    from kvferry.tools.bench import hf_baseline, paging
    from kvferry.tools.bench.floor import alternate_with_floor
    from kvferry.tools.bench.report import against_the_floor, say
    from kvferry.tools.bench.roofline_measure import add_quick_roofline

    hf_baseline.refuse_sampled(args)
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

    def run_once(rnd: int) -> dict:
        return run_engine(engine, workload.for_round(requests, rnd, engine.vocab_size))

    alternate_with_floor(args, "kvferry", run_once, hf_model, requests, report)
    if not args.no_roofline:
        add_quick_roofline(report, args, resolve_model(config.model), engine.device, engine.dtype, requests)
    if not args.no_paging:
        report["paging"] = paging.paging_overhead(engine)
        say(args, "paging overhead", report["paging"])
    if args.baseline == "hf":
        hf_baseline.add_hf_baseline(args, hf_model, requests, report)
    if args.json:
        print(json.dumps(report))
        return 0
    k = report["kvferry"]
    print(f"\n== {report['workload']} on {report['threads']} threads ==")
    print(
        f"kvferry output tok/s        {k['output_tok_per_s']:>10}   ({k['elapsed_s']} s, {k['output_tokens']} tokens; "
        f"runs {k['runs_s']} s; TTFT p50/p99 {k['ttft_p50_s']}/{k['ttft_p99_s']} s, "
        f"TPOT p50/p99 {k['tpot_p50_ms']}/{k['tpot_p99_ms']} ms)"
    )
    print("\n".join(against_the_floor(report)))
    if "paging" in report:
        print(paging.text(report["paging"]))
    return 0
