"""`kvferry bench scaling` end to end on a tiny model: kvferry serve and a second server, one after the other, each
measured from launch to serving, by the PSS of its processes per KV token and over a workload. llama.cpp is not
built here, so the second server is kvferry serve again, started by a script that takes llama-server's arguments:
a real OpenAI-compatible server over real HTTP, which is all the command needs of llama-server."""

import json
import os
import stat
import subprocess
import sys

import pytest

from tests.tiny_models import save_tiny_chat_model

pytestmark = pytest.mark.slow

ADAPTER = """#!/bin/bash
# llama-server's -m, -c and --port, as kvferry serve's --model, KV size and ports
while [ $# -gt 0 ]; do
  case "$1" in -m) model=$2; shift 2;; -c) ctx=$2; shift 2;; --port) port=$2; shift 2;; *) shift;; esac
done
exec {python} -m kvferry.tools.cli serve --model "$model" --port "$port" --control-port $((port + 1)) \\
  --kv-cache-memory 32MiB
"""


def test_both_servers_are_measured_one_after_the_other(tmp_path):
    folder = tmp_path / "tiny-chat"
    save_tiny_chat_model(folder)
    adapter = tmp_path / "llama-server"
    adapter.write_text(ADAPTER.format(python=sys.executable))
    adapter.chmod(adapter.stat().st_mode | stat.S_IXUSR)
    command = [
        sys.executable, "-m", "kvferry.tools.cli", "bench", "scaling", "--model", str(folder), "--gguf", str(folder),
        "--llama-server", str(adapter), "--ctx", "4096", "--workloads", "single-stream", "--quantization", "none",
        "--serve-arg=--kv-cache-memory=64MiB", "--port", "18177", "--log-dir", str(tmp_path), "--json",
    ]  # fmt: skip
    env = {**os.environ, "KVFERRY_NO_KV_HUGE_PAGES": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    kv, other = report["kvferry"], report["llama_server"]
    assert kv["start"] == "warm"  # float weights: nothing to prepare
    assert other["kv_tokens"] == 4096  # llama-server's -c, as given
    for side in (kv, other):
        assert 0 < side["ready_s"] < 600 and side["pss_gib"] > 0.05  # a Python process with torch at least
        assert side["single-stream"]["output_tok_per_s"] > 0 and side["single-stream"]["tpot_p50_ms"] > 0
    assert kv["kv_tokens"] > 10_000  # 64 MiB for the decode worker: its blocks' tokens, read off /v1/workers
    assert report["kvferry_over_llama_server"]["pss_per_kv_token"] > 0
    assert "serving on" in (tmp_path / "kvferry-serve.log").read_text()
