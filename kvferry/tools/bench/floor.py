"""The fp32 compute floor of a workload: the time a perfect engine would need, as the reference measurement the
project was specified with has it. Each step costs only transformers' own dense forward, in the ideal schedule:
every prompt prefilled in 512-token chunks, then every unfinished request decoded in every step.
"""

import time

import numpy as np
import torch

GRID = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512]
PREFILL_CHUNK = 512


@torch.inference_mode()
def step_costs(hf_model, reps: int = 3) -> dict[int, float]:
    """Seconds per forward for each grid size: above 64, one sequence of n tokens (logits for the last);
    otherwise n sequences of one token."""
    costs = {}
    sync = torch.cuda.synchronize if hf_model.device.type == "cuda" else lambda: None
    for n in GRID:
        prefill_like = n > 64
        shape = (1, n) if prefill_like else (n, 1)
        ids = torch.randint(1000, 2000, shape, device=hf_model.device)

        def forward():
            if prefill_like:
                hidden = hf_model.model(ids).last_hidden_state
                hf_model.lm_head(hidden[:, -1])
            else:
                hf_model(ids)

        forward()
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            forward()
        sync()  # on a GPU the forwards only queued
        costs[n] = (time.perf_counter() - start) / reps
    return costs


def floor_from_costs(costs: dict[int, float], requests: list[dict]) -> dict:
    def cost(n: int) -> float:
        return float(np.interp(n, GRID, [costs[g] for g in GRID]))

    prefill_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    prefill = (prefill_tokens // PREFILL_CHUNK) * costs[PREFILL_CHUNK] + cost(prefill_tokens % PREFILL_CHUNK)
    outputs = sorted(r["max_tokens"] for r in requests)
    decode = sum(cost(sum(1 for o in outputs if o > step)) for step in range(1, outputs[-1]))  # token 1: prefill
    total = prefill + decode
    return {
        "floor_s": round(total, 2),
        "prefill_s": round(prefill, 2),
        "decode_s": round(decode, 2),
        "floor_output_tok_per_s": round(sum(outputs) / total, 1),
        "step_ms": {k: round(v * 1000, 1) for k, v in costs.items()},
    }


def measure_floor(hf_model, requests: list[dict]) -> dict:
    return floor_from_costs(step_costs(hf_model), requests)


def alternate_with_floor(args, label: str, run_once, hf_model, requests: list[dict], report: dict, baseline_once=None):
    """Run the workload (and baseline_once, another server, when given) and measure the floor in alternation,
    keeping the best of each: on a shared machine a slow spell then hits every side rather than one.
    run_once(round) replays workload.for_round's requests: a later round must not find the earlier rounds'
    prompts in the prefix cache."""
    from kvferry.tools.bench.report import say

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
