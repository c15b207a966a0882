"""`kvferry bench scaling`'s parts on real processes: the PSS of a process tree counts its children, the ratios are
kvferry's over llama-server's, and a server that ends before serving is named with its log."""

import subprocess
import sys
import time

import pytest

from kvferry.tools.bench import scaling

CHILD_HOLDS = "import time, sys; b = bytearray(64 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(60)"


def test_the_pss_of_a_tree_counts_its_children():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {CHILD_HOLDS!r}]); time.sleep(60)",
        ],
        start_new_session=True,
    )
    try:
        deadline = time.time() + 30
        while len(scaling.process_tree(parent.pid)) < 2 and time.time() < deadline:
            time.sleep(0.1)
        pids = scaling.process_tree(parent.pid)
        assert pids[0] == parent.pid and len(pids) == 2
        time.sleep(1)  # the child's 64 MiB touched
        assert scaling.pss_bytes(pids) > scaling.pss_bytes(pids[:1]) + 60 * 2**20
    finally:
        scaling._stop(parent, 15)


def test_the_ratios_are_kvferrys_over_llama_servers():
    kv = {"pss_kib_per_kv_token": 300.0, "std-32": {"output_tok_per_s": 30.0}, "single-stream": {"tpot_p50_ms": 40.0}}
    ll = {"pss_kib_per_kv_token": 250.0, "std-32": {"output_tok_per_s": 12.0}, "single-stream": {"tpot_p50_ms": 80.0}}
    assert scaling.ratios(kv, ll) == {"pss_per_kv_token": 1.2, "std32_tok_per_s": 2.5, "one_stream_tpot": 0.5}
    assert scaling.ratios({"pss_kib_per_kv_token": 1.0}, {"pss_kib_per_kv_token": 2.0}) == {"pss_per_kv_token": 0.5}


def test_a_server_that_ends_before_serving_is_named_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    command = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(SystemExit, match=f"ended with 3 before serving \\({log} says why\\)"):
        scaling._launch(command, log, scaling._wait_healthy, 9)
    assert log.read_text() == "no model here\n"
