"""`kvferry bench feature --feature structured-output`: std-32 with every request constrained to a mid-size JSON
schema, against the same requests unconstrained, on one stack, in one invocation.

The schema asks for at least 40 records, which no std-32 request (256 tokens at most) can finish, so both sides
generate the same tokens' count. What is compared is the decode worker's own step time at batch 32, from its
trace spans: what constraining costs a step (filling each row's mask and applying it), apart from how the batches
happened to form. Rounds alternate off and on, so that a slow spell on a shared machine hits both; each side's
median step over all its rounds is compared. Time per output token and throughput are reported per round. Also measured: a cold compile and a
cache hit in process, and the first token of a request whose schema the workers see for the first time, against
the next one's.
"""

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from kvferry.common import settings
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


BATCH = 32  # the decode steps compared: every std-32 request in the batch


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


def decode_steps(trace_dir: str, windows: dict[str, list[tuple[float, float]]], batch_size: int) -> dict:
    """The decode worker's steps of exactly batch_size sequences (its "decode.step" spans), each side's by the
    wall-clock windows of its replays: their count and median milliseconds."""
    durations = {side: [] for side in windows}
    for name in os.listdir(trace_dir):
        with open(os.path.join(trace_dir, name), encoding="utf-8") as lines:
            for line in lines:
                span = json.loads(line)
                if span.get("name") != "decode.step" or span.get("attrs", {}).get("batch_size") != batch_size:
                    continue
                for side, spans in windows.items():
                    if any(lo <= span["ts"] <= hi for lo, hi in spans):
                        durations[side].append(span["dur"] * 1000)
    return {
        side: {"steps": len(d), "median_ms": round(statistics.median(d), 2) if d else None}
        for side, d in durations.items()
    }


def run(args) -> int:
    from transformers import AutoConfig

    from kvferry.common.model_files import resolve_model

    name = args.workload or "std-32"
    vocab_size = AutoConfig.from_pretrained(resolve_model(args.model)).vocab_size
    requests = workload.generate(name, vocab_size)
    warmup = [dict(r, max_tokens=4, arrival_s=0.0) for r in workload.generate("std-32", vocab_size, seed=99)[:2]]
    report = {"feature": "structured-output", "workload": name, "rounds": args.repeat, **compile_times(args.model)}
    sides, windows = {"off": [], "on": []}, {"off": [], "on": []}
    trace_dir = tempfile.mkdtemp(prefix="kvferry-bench-structured-")
    # Without prefix caching: both sides replay the same prompts, and the later ones would find them cached. With
    # tracing, on both sides: the decode worker's step spans time each step and say its batch size.
    env = {settings.env_name("no_prefix_caching"): "1", settings.env_name("trace_dir"): trace_dir}
    try:
        with fresh_stack(args.model, env, prefill_threads=args.prefill_threads, decode_threads=args.decode_threads) as (
            url,
            _,
        ):
            model = served_model(url)
            asyncio.run(replay(url, model, warmup))
            # A schema the workers have not seen (another maxItems: another text), then the same one again.
            records = SCHEMA["properties"]["records"]
            fresh = constrained({**SCHEMA, "properties": {"records": {**records, "maxItems": 61}}})
            # The same prompt twice (prefix caching is off): the difference is the compile.
            report["ttft_first_sight_s"] = first_token_s(url, model, warmup[0], fresh)
            report["ttft_cached_s"] = first_token_s(url, model, warmup[0], fresh)
            asyncio.run(replay(url, model, warmup, constrained(SCHEMA)))  # the measured schema, compiled
            for i in range(args.repeat):
                for side in ("off", "on"):
                    extra = constrained(SCHEMA) if side == "on" else None
                    started = time.time()
                    sides[side].append(asyncio.run(replay(url, model, requests, extra)))
                    windows[side].append((started, time.time()))
                    print(f"round {i + 1} structured-output {side}: " + json.dumps(sides[side][-1]), file=sys.stderr)
        steps = decode_steps(trace_dir, windows, BATCH)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    off_ms, on_ms = steps["off"]["median_ms"], steps["on"]["median_ms"]
    report.update(
        decode_steps_at_batch=BATCH,
        decode_steps=steps,
        decode_step_overhead=round(on_ms / off_ms - 1, 4) if off_ms and on_ms else None,
        tpot_p50_ms={side: [r["tpot_p50_ms"] for r in runs] for side, runs in sides.items()},
        output_tok_per_s={side: [r["output_tok_per_s"] for r in runs] for side, runs in sides.items()},
    )
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\n== structured output off vs on, workload {name} ({args.repeat} rounds, one stack) ==")
    for side in ("off", "on"):
        print(
            f"{side:>3}: decode step at batch {BATCH}: median {steps[side]['median_ms']} ms over {steps[side]['steps']} "
            f"steps; time per output token p50 by round {report['tpot_p50_ms'][side]} ms; tok/s by round "
            f"{report['output_tok_per_s'][side]}"
        )
    overhead = report["decode_step_overhead"]
    print(f"constrained decode step at batch {BATCH}: " + (f"{overhead:+.1%}" if overhead is not None else "no steps"))
    print(
        f"compile in process: cold {report['cold_compile_ms']} ms, cached {report['cached_compile_ms']} ms; first "
        f"token of a new schema {report['ttft_first_sight_s']} s, of the same schema next {report['ttft_cached_s']} s"
    )
    return 0
