"""Soak: 1,000 requests over 2 prefill and 2 decode workers, a seeded fifth of them cancelled at random points
(queued, prefilling, decoding), each before its last token, so that exactly the planned number ends cancelled. No
block leaks, no stuck request, and no process grows by more than 10% after warm-up.

On a tiny model by default. KVFERRY_SOAK_MODEL=default (or a model's name or folder) soaks a real model instead, as
`kvferry bench soak` did until 2026-12-07: its compute is what grew oneDNN's per-shape kernel caches (docs/
benchmarks.md, "Reliability, soak and overload"). `pytest -s` prints the report, resident memory every 100
requests included."""

import os

import pytest

from kvferry.services.launcher import free_port, start_services, stop_all
from tests.e2e.soak import plan, soak
from tests.tiny_models import save_tiny_chat_model

pytestmark = pytest.mark.slow


SOAK_MODEL = os.environ.get("KVFERRY_SOAK_MODEL")


def test_soak_with_cancellations_leaks_nothing(tmp_path):
    env = {
        **os.environ,
        "KVFERRY_KV_CACHE_MEMORY": "256MiB",
        "KVFERRY_HEARTBEAT_INTERVAL": "0.5",
        "KVFERRY_NO_KV_HUGE_PAGES": "1",  # as stack.py's: a faster start
    }
    if SOAK_MODEL:
        cancel_within_s = 0.6  # a request's usual length on SmolLM2
        if SOAK_MODEL != "default":
            env["KVFERRY_MODEL"] = SOAK_MODEL
    else:
        # A tiny model with the default's tokenizer: the soak is about the serving system, and SmolLM2's compute
        # took three of its four minutes.
        save_tiny_chat_model(tmp_path / "tiny-chat")
        env["KVFERRY_MODEL"] = str(tmp_path / "tiny-chat")
        cancel_within_s = 0.15  # the tiny model's requests take about that long
    port = free_port()
    procs = start_services("127.0.0.1", port, free_port(), 1, 1, env, num_prefill=2, num_decode=2)
    try:
        names = ["gateway", "prefill-0", "prefill-1", "decode-0", "decode-1"]
        report = soak(
            f"http://127.0.0.1:{port}",
            {n: p.pid for n, p in zip(names, procs)},
            num_requests=1000,
            cancel_within_s=cancel_within_s,
        )
    finally:
        stop_all(procs)
    print(f"\nsoak: {report}")
    outcomes = report["outcomes"]
    assert set(outcomes) <= {"ok", "cancelled"}, outcomes
    planned = [
        cancel for _, _, cancel in plan(1000, 0.2, cancel_within_s, seed=0)
    ]  # soak's defaults: share 0.2, seed 0
    assert report["cancels_planned"] == sum(c is not None for c in planned) == 209  # the seed's own count
    assert {kind for kind, _ in filter(None, planned)} == {"tokens", "time"}
    assert outcomes["cancelled"] == 209 and outcomes["ok"] == 1000 - 209
    assert report["workers"] == 4 and report["blocks_leaked"] == {} and report["requests_stuck"] == 0
    assert all(growth < 0.10 for growth in report["rss_growth"].values()), report["rss_mib_every_100"]
