"""Replay a workload through the in-process engine, all requests at once, and time it."""

import time

import numpy as np

from kvferry.common.sampling import SamplingParams


def run_engine(engine, requests: list[dict]) -> dict:
    start = time.perf_counter()
    first_token_at, finished_at, num_out = {}, {}, {}
    for r in requests:
        engine.add_request(
            r["prompt_token_ids"],
            SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True),
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
    ttft = np.array([first_token_at[r["id"]] for r in requests])
    tpot = np.array([(finished_at[r["id"]] - first_token_at[r["id"]]) / max(1, r["max_tokens"] - 1) for r in requests])
    total_out = sum(num_out.values())
    return {
        "elapsed_s": round(elapsed, 2),
        "output_tokens": total_out,
        "output_tok_per_s": round(total_out / elapsed, 1),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "num_steps": num_steps,
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
        "tpot_p50_ms": round(float(np.percentile(tpot, 50)) * 1000, 1),
        "tpot_p99_ms": round(float(np.percentile(tpot, 99)) * 1000, 1),
        "preemptions": engine.scheduler.num_preemptions,
    }
