"""`kvferry bench ab --feature structured-output`: std-32 with every request held to a mid-size JSON schema, against
the same requests unconstrained, on one stack, rounds alternating.

The schema asks for at least 40 records, more than any std-32 output holds, so both sides generate as many tokens.
How served batches form differs between runs, so the decode step at batch 32 is also timed in process after the
stack stops, with and without the constraint. Also: a cold compile against a cache hit, and the first token of a
schema the workers have not seen against the next one's.
"""

import asyncio
import json
import statistics
import sys
import time

from kvferry.common import settings
from kvferry.common.constraint import Constraint
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


SCHEMA_CONSTRAINT = Constraint("json", json.dumps(SCHEMA, separators=(",", ":")), "structured_outputs.json")
BATCH = 32  # the decode steps compared: every std-32 request in the batch


def constrained(schema: dict) -> dict:
    return {"structured_outputs": {"json": schema}}


def compile_times(model: str | None) -> dict:
    """A cold compile of SCHEMA and a cache hit, in this process, as a worker does them."""
    from transformers import AutoTokenizer

    from kvferry.common.model_files import resolve_model
    from kvferry.common.structured.grammars import GrammarCache

    folder = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    grammars = GrammarCache(lambda: tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    started = time.perf_counter()
    grammars.compile(SCHEMA_CONSTRAINT)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    grammars.compile(SCHEMA_CONSTRAINT)
    return {
        "cold_compile_ms": round(cold * 1000, 1),
        "cached_compile_ms": round((time.perf_counter() - started) * 1000, 3),
    }


def first_token_s(url: str, model: str, request: dict, extra_body: dict) -> float:
    one = dict(request, max_tokens=4, arrival_s=0.0)
    return asyncio.run(replay(url, model, [one], extra_body))["ttft_p50_s"]


def decode_step_ms(args, constraint: Constraint, rounds: int) -> dict:
    """bench step's decode step at batch 32, unconstrained and constrained in alternate rounds: each side's median."""
    from kvferry.common.config import EngineConfig
    from kvferry.common.engine import LLMEngine
    from kvferry.tools.bench.step import measure

    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.decode_threads))
    steps = {"off": [], "on": []}
    for _ in range(rounds):
        for side in ("off", "on"):
            found = measure(engine, BATCH, 256, 20, constraint if side == "on" else None)
            steps[side].append(found["step_ms"])
    return {side: statistics.median(ms) for side, ms in steps.items()} | {"rounds_ms": steps}


def run(args) -> int:
    from kvferry.common.model_config import ModelConfig
    from kvferry.common.model_files import resolve_model

    name = args.workload or "std-32"
    vocab_size = ModelConfig.load(resolve_model(args.model)).vocab_size
    requests = workload.generate(name, vocab_size)
    warmup = workload.warmup(vocab_size, max_tokens=4)
    report = {"feature": "structured-output", "workload": name, "rounds": args.repeat, **compile_times(args.model)}
    served = {"off": [], "on": []}
    # Without prefix caching: both sides replay the same prompts, and the later ones would find them cached.
    env = {settings.env_name("no_prefix_caching"): "1"}
    threads = {"prefill_threads": args.prefill_threads, "decode_threads": args.decode_threads}
    with fresh_stack(args.model, env, **threads) as (url, _):
        model = served_model(url)
        asyncio.run(replay(url, model, warmup))
        # A schema the workers have not seen (another maxItems: another text), then the same one again, on the
        # same prompt (prefix caching is off): the difference is the compile.
        records = SCHEMA["properties"]["records"]
        fresh = constrained({**SCHEMA, "properties": {"records": {**records, "maxItems": 61}}})
        report["ttft_first_sight_s"] = first_token_s(url, model, warmup[0], fresh)
        report["ttft_cached_s"] = first_token_s(url, model, warmup[0], fresh)
        asyncio.run(replay(url, model, warmup, constrained(SCHEMA)))  # the measured schema, compiled
        for i in range(args.repeat):
            for side in ("off", "on"):
                served[side].append(
                    asyncio.run(replay(url, model, requests, constrained(SCHEMA) if side == "on" else None))
                )
                print(f"round {i + 1} structured-output {side}: " + json.dumps(served[side][-1]), file=sys.stderr)
    # After the stack: the engine measured alone, on the cores the stack had.
    steps = decode_step_ms(args, SCHEMA_CONSTRAINT, args.repeat)
    report.update(
        decode_step_ms=steps,
        decode_step_overhead=round(steps["on"] / steps["off"] - 1, 4),
        tpot_p50_ms={side: [r["tpot_p50_ms"] for r in runs] for side, runs in served.items()},
        output_tok_per_s={side: [r["output_tok_per_s"] for r in runs] for side, runs in served.items()},
    )
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\n== structured output off vs on, workload {name} ({args.repeat} rounds) ==")
    for side in ("off", "on"):
        print(
            f"{side:>3}: served, time per output token p50 by round {report['tpot_p50_ms'][side]} ms, tok/s by round "
            f"{report['output_tok_per_s'][side]}; engine decode step at batch {BATCH} by round "
            f"{steps['rounds_ms'][side]} ms"
        )
    print(
        f"constrained decode step at batch {BATCH}: {steps['on']:.1f} against {steps['off']:.1f} ms, "
        f"{report['decode_step_overhead']:+.1%}"
    )
    print(
        f"compile in process: cold {report['cold_compile_ms']} ms, cached {report['cached_compile_ms']} ms; first "
        f"token of a new schema {report['ttft_first_sight_s']} s, of the same schema next {report['ttft_cached_s']} s"
    )
    return 0
