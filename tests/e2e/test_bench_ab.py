"""`kvferry bench ab`: the A/B loop on real fresh stacks (a tiny model with the default's tokenizer), once for a
feature that hangs on a switch (prefix caching: the on side computes far fewer prompt tokens) and once for an
observer (tracing: the on side writes trace lines, the off side none)."""

import json
import os
import subprocess
import sys

import pytest

from tests.tiny_models import save_tiny_chat_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ab") / "tiny-chat"
    save_tiny_chat_model(folder)
    return str(folder)


def bench(*argv: str) -> dict:
    env = {**os.environ, "KVFERRY_KV_CACHE_MEMORY": "256MiB", "KVFERRY_NO_KV_HUGE_PAGES": "1"}
    command = [sys.executable, "-m", "kvferry.tools.cli", "bench", *argv, "--repeat", "1", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_prefix_caching_on_computes_fewer_prompt_tokens_over_the_shared_prefix_workload(tiny):
    report = bench("ab", "--feature", "prefix-caching", "--model", tiny)
    assert report["feature"] == "prefix-caching" and report["workload"] == "shared-prefix"
    assert report["off"]["prefill"]["prompt_tokens_cached"] == 0
    assert report["on"]["prefill"]["prompt_tokens_cached"] > 0
    # 32 prompts behind one 400-token system prompt: all but the first find its 25 full blocks cached.
    assert report["prompt_tokens_computed_drop"] > 0.5
    assert report["ttft_p50_speedup"] == round(report["off"]["ttft_p50_s"] / report["on"]["ttft_p50_s"], 2)


def test_the_ab_loop_for_the_tracing_observer(tiny):
    report = bench("ab", "--feature", "tracing", "--model", tiny)
    assert report["workload"] == "std-32"
    assert len(report["off_tok_per_s"]) == len(report["on_tok_per_s"]) == 1
    assert report["lines"] > 0 and report["bytes"] > 0
    assert report["overhead"] == round(1 - report["best_on"] / report["best_off"], 4)
