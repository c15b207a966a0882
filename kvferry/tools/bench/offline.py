"""Replay a workload through the in-process engine, all requests at once, and time it."""

import time

from kvferry.common.sampling import SamplingParams
from kvferry.tools.percentiles import summary


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
