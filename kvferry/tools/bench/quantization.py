"""`kvferry bench quantization`: int8 against the unquantized model, in one process; with --kv-cache, a half-precision
KV cache against a float32 one instead (the same weights on both sides).

Accuracy on text neither side was calibrated on (Python's reference documentation, other topics than calibration's):
each next token's logprob difference and top-1 agreement (teacher-forced), and greedy chat outputs' agreement up to
the first difference. Speed: std-32 through each engine in alternation, best of --repeat, beside the fp32 floor.
"""

import json

from kvferry.common import settings
from kvferry.common.config import EngineConfig
from kvferry.common.sampling import SamplingParams

HELD_OUT_TOPICS = (
    "assert",
    "binary",
    "calls",
    "comparisons",
    "dict",
    "floating",
    "for",
    "lambda",
    "numbers",
    "raise",
    "slicings",
    "with",
)
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in two sentences.",
    "List three uses of a hash table.",
    "How do plants make their food?",
    "Give me a tip for learning Python.",
    "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet.",
)


def held_out_texts(limit_chars: int = 2000) -> list[str]:
    from pydoc_data.topics import topics

    from kvferry.common.model.quant_calibration import CALIBRATION_TOPICS  # torch: not when the CLI is built

    assert not set(HELD_OUT_TOPICS) & set(CALIBRATION_TOPICS)
    return [topics[name][:limit_chars] for name in HELD_OUT_TOPICS]


def teacher_forced(engine, token_lists: list[list[int]]) -> list[list]:
    """Per text, every prompt position's TokenLogprobs (the actual next token's logprob and the top-1)."""
    outs = engine.generate(token_lists, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    return [[entry for entry in out.prompt_logprobs if entry is not None] for out in outs]


def compare_logprobs(reference: list[list], quantized: list[list]) -> dict:
    diffs, agree = [], []
    for ref_text, q_text in zip(reference, quantized):
        for r, q in zip(ref_text, q_text, strict=True):
            diffs.append(abs(r.logprob - q.logprob))
            agree.append(r.top_ids[0] == q.top_ids[0])
    return {
        "positions": len(diffs),
        "logprob_mad": round(sum(diffs) / len(diffs), 4),
        "top1_agreement": round(sum(agree) / len(agree), 4),
    }


def compare_greedy(reference: list[list[int]], quantized: list[list[int]]) -> dict:
    prefix = same = total = 0
    for r, q in zip(reference, quantized):
        n = next((i for i, (a, b) in enumerate(zip(r, q)) if a != b), min(len(r), len(q)))
        prefix, total, same = prefix + n, total + len(r), same + (r == q)
    return {"greedy_prefix_agreement": round(prefix / total, 4), "greedy_identical_outputs": f"{same}/{len(reference)}"}


def accuracy(
    reference_engine,
    quantized_engine,
    texts: list[str],
    chat_prompts: list[str],
    max_tokens: int = 64,
    max_text_tokens: int = 256,
) -> dict:
    tokens = [reference_engine.encode(t)[:max_text_tokens] for t in texts]
    report = compare_logprobs(teacher_forced(reference_engine, tokens), teacher_forced(quantized_engine, tokens))
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    prompts = [reference_engine.encode(p, chat=True) for p in chat_prompts]
    outputs = [[o.output_token_ids for o in e.generate(prompts, params)] for e in (reference_engine, quantized_engine)]
    return {**report, **compare_greedy(*outputs)}


def add_parser(bench) -> None:
    p = bench.add_parser(
        "quantization",
        help="--quantization int8 (or the one given, e.g. int4) against the unquantized model: accuracy and speed",
    )
    p.add_argument(
        "--kv-cache",
        action="store_true",
        help="compare the KV cache's type instead: --kv-cache-dtype (auto: the CPU's half precision) against float32, "
        "both with --quantization as given",
    )
    p.add_argument("--repeat", type=int, default=2, help="std-32 runs of each engine, alternated; the best is kept")
    p.add_argument("--no-speed", action="store_true", help="accuracy only")
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--json", action="store_true")
    settings.add_arguments(p, settings.BENCH)
    p.set_defaults(func=cmd_bench_quantization)


def cmd_bench_quantization(args) -> int:
    from dataclasses import replace

    import torch

    from kvferry.common.engine import LLMEngine
    from kvferry.tools.bench import workload
    from kvferry.tools.bench.floor import measure_floor
    from kvferry.tools.bench.hf_baseline import load_hf_model
    from kvferry.tools.bench.offline import run_engine
    from kvferry.tools.bench.report import say

    config = EngineConfig.from_args(args)
    config.num_threads = config.num_threads or 2
    if args.kv_cache:  # the reference first, then the candidate
        half = LLMEngine(config)
        engines = {"float32 KV": LLMEngine(replace(config, kv_cache_dtype="float32"))}
        engines[f"{str(half.kv_dtype).removeprefix('torch.')} KV"] = half
    else:
        kind = config.quantization or "int8"  # --quantization int4 measures int4
        engines = {
            "unquantized": LLMEngine(replace(config, quantization=None)),
            kind: LLMEngine(replace(config, quantization=kind)),
        }
    (reference_name, reference), (candidate_name, candidate) = engines.items()
    report = {
        "threads": torch.get_num_threads(),
        "dtype": str(candidate.dtype).removeprefix("torch."),
        "compared": [reference_name, candidate_name],
        "accuracy": accuracy(reference, candidate, held_out_texts(), list(CHAT_PROMPTS)),
    }
    say(args, "accuracy", report["accuracy"])
    if not args.no_speed:
        requests = workload.generate("std-32", candidate.vocab_size)
        runs = {name: [] for name in engines}
        floors = []
        hf_model = None if args.no_floor else load_hf_model(candidate)
        for engine in engines.values():
            engine.generate([workload.warmup_prompt(engine.vocab_size)], None)  # warm-up
        for i in range(args.repeat):
            for name, engine in engines.items():
                runs[name].append(run_engine(engine, workload.for_round(requests, i, engine.vocab_size)))
                say(args, f"{name} run {i + 1}", runs[name][-1])
            if hf_model is not None:
                floors.append(measure_floor(hf_model, requests))
        best = {name: min(r, key=lambda x: x["elapsed_s"]) for name, r in runs.items()}
        report["std32"] = {
            name: {k: b[k] for k in ("output_tok_per_s", "elapsed_s", "ttft_p50_s", "tpot_p50_ms")}
            for name, b in best.items()
        }
        report["std32"]["speedup"] = round(best[reference_name]["elapsed_s"] / best[candidate_name]["elapsed_s"], 3)
        if floors:
            floor = min(floors, key=lambda f: f["floor_s"])
            report["std32"]["floor_output_tok_per_s"] = floor["floor_output_tok_per_s"]
            for name, b in best.items():
                report["std32"][name]["fraction_of_floor"] = round(floor["floor_s"] / b["elapsed_s"], 3)
    if args.json:
        print(json.dumps(report))
        return 0
    a = report["accuracy"]
    print(f"\n== {candidate_name} against {reference_name} ({report['dtype']} model), {report['threads']} threads ==")
    print(
        f"held-out text, {a['positions']} positions: logprob MAD {a['logprob_mad']}, top-1 agreement "
        f"{a['top1_agreement']:.1%}"
    )
    print(
        f"greedy chat outputs: {a['greedy_prefix_agreement']:.1%} of tokens equal up to the first difference, "
        f"{a['greedy_identical_outputs']} outputs identical"
    )
    if "std32" in report:
        s = report["std32"]
        for name in engines:
            extra = f", {s[name]['fraction_of_floor']:.0%} of the fp32 floor" if "fraction_of_floor" in s[name] else ""
            print(
                f"std-32 {name:<12} {s[name]['output_tok_per_s']:>7} tok/s (TTFT p50 {s[name]['ttft_p50_s']} s, "
                f"TPOT p50 {s[name]['tpot_p50_ms']} ms{extra})"
            )
        print(
            f"{candidate_name} speed-up {s['speedup']}x"
            + (f"; floor {s['floor_output_tok_per_s']} tok/s" if "floor_output_tok_per_s" in s else "")
        )
    return 0
