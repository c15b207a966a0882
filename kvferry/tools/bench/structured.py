"""`kvferry bench feature --feature structured-output`: std-32 with every request constrained to a mid-size JSON
schema, against the same requests unconstrained, on one stack, in one invocation.

The schema asks for at least 40 records, which no std-32 request (256 tokens at most) can finish, so both sides
generate the same tokens' count and ride the same batches: the difference in time per output token is what
constraining costs a decode step (filling each row's mask and applying it). Rounds alternate off and on, so that a
slow spell on a shared machine hits both; the best of each side is compared. Also measured: a cold compile and a
cache hit in process, and the first token of a request whose schema the workers see for the first time, against
the next one's.
"""

import asyncio
import json
import sys
import time

from kvferry.tools.bench import workload
from kvferry.tools.bench.serve import replay
from kvferry.tools.bench.stack import fresh_stack, served_model

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "small", "large"]}, "maxItems": 4},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "owner": {
            "type": "object",
            "properties": {"email": {"type": "string", "format": "email"}, "team": {"enum": ["a", "b", "c"]}},
            "required": ["team"],
        },
    },
    "required": ["name", "id", "tags", "active", "score"],
}
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 40, "maxItems": 60}},
    "required": ["records"],
}


def constrained(schema: dict) -> dict:
    return {"structured_outputs": {"json": schema}}


def compile_times(model: str | None) -> dict:
    """A cold compile of SCHEMA and a cache hit, in this process, as a worker does them."""
    from transformers import AutoTokenizer

    from kvferry.common.constraint import Constraint
    from kvferry.common.model_files import resolve_model
    from kvferry.common.structured.grammars import GrammarCache

    folder = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    grammars = GrammarCache(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    constraint = Constraint("json", json.dumps(SCHEMA, separators=(",", ":")), "structured_outputs.json")
    started = time.perf_counter()
    grammars.compile(constraint)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    grammars.compile(constraint)
    return {
        "cold_compile_ms": round(cold * 1000, 1),
        "cached_compile_ms": round((time.perf_counter() - started) * 1000, 3),
    }


def first_token_s(url: str, model: str, request: dict, extra_body: dict) -> float:
    one = dict(request, max_tokens=4, arrival_s=0.0)
    return asyncio.run(replay(url, model, [one], extra_body))["ttft_p50_s"]


def run(args) -> int:
    from transformers import AutoConfig

    from kvferry.common.model_files import resolve_model

    name = args.workload or "std-32"
    vocab_size = AutoConfig.from_pretrained(resolve_model(args.model)).vocab_size
    requests = workload.generate(name, vocab_size)
    warmup = [dict(r, max_tokens=4, arrival_s=0.0) for r in workload.generate("std-32", vocab_size, seed=99)[:2]]
    report = {"feature": "structured-output", "workload": name, "rounds": args.repeat, **compile_times(args.model)}
    sides = {"off": [], "on": []}
    with fresh_stack(args.model, {}, prefill_threads=args.prefill_threads, decode_threads=args.decode_threads) as (
        url,
        _,
    ):
        model = served_model(url)
        asyncio.run(replay(url, model, warmup))
        # A schema the workers have not seen (another maxItems: another text), then the same one again.
        fresh = constrained({**SCHEMA, "properties": {"records": {**SCHEMA["properties"]["records"], "maxItems": 61}}})
        report["ttft_first_sight_s"] = first_token_s(url, model, warmup[0], fresh)
        report["ttft_cached_s"] = first_token_s(url, model, warmup[1], fresh)
        asyncio.run(replay(url, model, warmup, constrained(SCHEMA)))  # the measured schema, compiled
        for i in range(args.repeat):
            for side in ("off", "on"):
                extra = constrained(SCHEMA) if side == "on" else None
                sides[side].append(asyncio.run(replay(url, model, requests, extra)))
                print(f"round {i + 1} structured-output {side}: " + json.dumps(sides[side][-1]), file=sys.stderr)
    best = {side: min(runs, key=lambda r: r["tpot_p50_ms"]) for side, runs in sides.items()}
    off, on = best["off"], best["on"]
    report.update(
        off=off,
        on=on,
        decode_step_overhead=round(on["tpot_p50_ms"] / off["tpot_p50_ms"] - 1, 4),
        throughput_ratio=round(on["output_tok_per_s"] / off["output_tok_per_s"], 3),
    )
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\n== structured output off vs on, workload {name} ({args.repeat} rounds, one stack, best of each) ==")
    for side in ("off", "on"):
        r = best[side]
        print(
            f"{side:>3}: time per output token p50/p99 {r['tpot_p50_ms']}/{r['tpot_p99_ms']} ms, TTFT p50 "
            f"{r['ttft_p50_s']} s, {r['output_tok_per_s']} tok/s ({r['elapsed_s']} s)"
        )
    print(
        f"constrained decode step: {report['decode_step_overhead']:+.1%} time per output token; throughput "
        f"{report['throughput_ratio']}x"
    )
    print(
        f"compile in process: cold {report['cold_compile_ms']} ms, cached {report['cached_compile_ms']} ms; first "
        f"token of a new schema {report['ttft_first_sight_s']} s, of the same schema next {report['ttft_cached_s']} s"
    )
    return 0
