"""Parts that run the project's own commands: the kernel tests, `kvferry bench step`, `bench engine`, a real
stack under `bench serve`; and, apart, transformers' continuous batching on the same workload."""

import importlib.util
import json
import os
import re
import sys
import traceback
import xml.etree.ElementTree as ET

from kvferry.common import settings
from kvferry.tools.gpu_check.part import SOURCE_ROOT, Context, PartFailed, excerpt, stream

KERNEL_TESTS = (  # the kernels, compiled; and the tests that skip without CUDA (graphs, pinned copies, side streams)
    "tests/unit/test_kernels.py",
    "tests/unit/test_int8.py",
    "tests/integration/test_runner_cuda_paths.py",
    "tests/unit/test_kv_gather_frames.py",
)
# Run inside pytest's process, to see what tests/conftest.py left in the environment once the tests ran.
PYTEST_THEN_REPORT_INTERPRETER = (
    "import os, sys, pytest; rc = pytest.main(sys.argv[1:]); "
    "print('gpu-check: TRITON_INTERPRET during the tests: %r' % os.environ.get('TRITON_INTERPRET'), flush=True); "
    "sys.exit(int(rc))"
)
GRAPHS_FAILED = re.compile(r"captur\w* the decode CUDA graphs failed")
GRAPHS_CAPTURED = "decode CUDA graphs for batch sizes"  # the engine's log line once they are captured
PYTEST_WORKERS = 8  # processes compiling at once (of the machine's 16 cores); each holds a CUDA context of its own
MAX_NUM_SEQS = "32"  # std-32 and bench step's batch fit; fewer graph sizes to capture than the default's


def kernel_tests(ctx: Context) -> None:
    missing = [t for t in KERNEL_TESTS if not (SOURCE_ROOT / t).is_file()]
    if missing:
        raise PartFailed(f"{', '.join(missing)} not found under {SOURCE_ROOT}: run the check from a source tree")
    junit = ctx.work / "kernel_tests.xml"
    argv = [sys.executable, "-c", PYTEST_THEN_REPORT_INTERPRETER, "-q", "-p", "no:cacheprovider", "-rfE"]
    # Only the plugins these tests need: the machine's image has many that load themselves, each taking seconds
    # of every worker's start (these tests need none but xdist).
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if not ctx.dry_run and importlib.util.find_spec("xdist"):
        # Each test's first launch compiles its kernels: on several cores.
        argv += ["-p", "xdist.plugin", "-n", str(PYTEST_WORKERS)]
    argv += [f"--junitxml={junit}", *KERNEL_TESTS]
    returncode, output = stream(argv, env)
    interpreted = re.search(r"TRITON_INTERPRET during the tests: (.*)", output)
    counts = _junit_counts(junit)
    ctx.record("tests", counts)
    ctx.record("exit_status", returncode)
    ctx.record("TRITON_INTERPRET_during_tests", interpreted.group(1) if interpreted else "unknown")
    compiled = interpreted is not None and interpreted.group(1) == "None"
    ctx.summary = (
        f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped, "
        + ("compiled" if compiled else "UNDER THE INTERPRETER")
    )
    if returncode != 0:
        failing = ", ".join(counts.get("failing", []))
        raise PartFailed(
            f"{ctx.summary}; failing: {failing or 'none recorded'}\n"
            + (f"the first: {counts['first_failure']}" if counts.get("first_failure") else excerpt(output))
        )
    if not compiled and not ctx.dry_run:
        raise PartFailed(f"{ctx.summary}: TRITON_INTERPRET was set during the tests (tests/conftest.py?)")


def _junit_counts(path) -> dict:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    cases = list(root.iter("testcase"))
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = sum(c.find("skipped") is not None for c in cases)
    first_failure = None
    if failed:
        element = failed[0].find("failure")
        element = element if element is not None else failed[0].find("error")
        text = (element.text or element.get("message") or "").strip()
        first_failure = f"{failed[0].get('classname')}.{failed[0].get('name')}:\n{excerpt(text, 1200)}"
    return {
        "total": len(cases),
        "passed": len(cases) - len(failed) - skipped,
        "failed": len(failed),
        "skipped": skipped,
        "failing": [f"{c.get('name')}" for c in failed[:30]],
        "first_failure": first_failure,
        "seconds": round(sum(float(c.get("time") or 0) for c in cases), 1),
    }


def bench_step(ctx: Context) -> None:
    sizes = ["--batch", "4", "--context", "32", "--steps", "4"] if ctx.dry_run else []
    _eager_against_graphs(ctx, ["bench", "step", *sizes], "step_ms")
    e, g = ctx.findings["eager"], ctx.findings["graphs"]
    ctx.summary = (
        f"decode step at batch {g['batch']}, context {g['context']}: eager {e['step_ms']} ms (model {e['model_ms']} "
        f"ms), graphs {g['step_ms']} ms (model {g['model_ms']} ms): {ctx.findings['graphs_speedup']}x"
    )


def bench_engine(ctx: Context) -> None:
    flags = ["--workload", "std-32", "--no-floor", "--no-paging", "--no-roofline", "--repeat", "1"]
    _eager_against_graphs(ctx, ["bench", "engine", *flags], "elapsed_s")
    e, g = ctx.findings["eager"]["kvferry"], ctx.findings["graphs"]["kvferry"]
    ctx.summary = (
        f"std-32: eager {e['output_tok_per_s']} tok/s (TPOT p50 {e['tpot_p50_ms']} ms), graphs "
        f"{g['output_tok_per_s']} tok/s (TPOT p50 {g['tpot_p50_ms']} ms): {ctx.findings['graphs_speedup']}x"
    )


def _eager_against_graphs(ctx: Context, command: list[str], time_key: str) -> None:
    base = ctx.kvferry(*command, "--model", ctx.model_dir, "--max-num-seqs", MAX_NUM_SEQS, "--json")
    eager, _ = ctx.run_json([*base, "--enforce-eager"])
    ctx.record("eager", eager)
    graphs, log = ctx.run_json(base)
    ctx.record("graphs", graphs)
    ctx.record("graphs_captured_line", next((line for line in log.splitlines() if GRAPHS_CAPTURED in line), None))
    if GRAPHS_FAILED.search(log):
        raise PartFailed("the decode CUDA graphs were not captured, so 'graphs' ran eager (see the output tail)")
    seconds = lambda r: r[time_key] if time_key in r else r["kvferry"][time_key]
    ctx.record("graphs_speedup", round(seconds(eager) / max(1e-9, seconds(graphs)), 2))


def serve(ctx: Context) -> None:
    """The stack alone on the GPU (transformers' baseline is a part of its own, once the stack has stopped: a
    slow or broken baseline must not take the stack's figures down with it)."""
    from kvferry.tools.bench.stack import fresh_stack

    env = {settings.env_name("max_num_seqs"): MAX_NUM_SEQS}
    with fresh_stack(str(ctx.model_dir), env) as (url, procs):
        ctx.record("stack", {"url": url, "processes": {"gateway": procs[0].pid, "workers": [p.pid for p in procs[1:]]}})
        flags = ["--workload", "std-32", "--no-floor", "--repeat", "1", "--json"]
        report, _ = ctx.run_json(ctx.kvferry("bench", "serve", "--url", url, "--model", ctx.model_dir, *flags))
        ctx.record("bench_serve", report)
    k = report["kvferry"]
    ctx.summary = (
        f"std-32 over HTTP: {k['output_tok_per_s']} tok/s (TTFT p50 {k['ttft_p50_s']} s, TPOT p50 {k['tpot_p50_ms']} "
        f"ms, KV transfer p50 {k['kv_transfer_p50_ms']} ms)"
    )


def hf_baseline(ctx: Context) -> None:
    """transformers' own continuous batching on std-32, in this process, the GPU to itself. Whatever breaks is
    recorded as the baseline's failure; kvferry's figures are the serve part's."""
    import torch
    from transformers import AutoConfig

    from kvferry.tools.bench import hf_baseline, workload

    try:
        ctx.record("stage", "loading the model")
        model = hf_baseline.load_hf_model_dir(ctx.model_dir)
        ctx.record("model", {"device": str(model.device), "dtype": str(model.dtype).removeprefix("torch.")})
        requests = workload.generate("std-32", AutoConfig.from_pretrained(ctx.model_dir).vocab_size)
        # Its own limit, short of the part's: a hang then says where it was instead of being killed.
        result = hf_baseline.run_hf_continuous_batching(
            model, requests, timeout_s=max(5.0, ctx.seconds_left() - 4), stage=lambda name: ctx.record("stage", name)
        )
    except Exception as exc:
        formatted = traceback.format_exc()
        print(formatted, file=sys.stderr, flush=True)
        failure = f"{type(exc).__name__}: {exc}"
        stage = ctx.findings.get("stage")
        ctx.record("failed", {"stage": stage, "error": failure, "traceback": excerpt(formatted)})
        raise PartFailed(
            f"transformers' continuous batching (the baseline, not kvferry) failed in {stage}: {failure}\n"
            + excerpt(formatted, 1200)
        ) from exc
    result["torch"] = torch.__version__
    ctx.record("transformers_continuous_batching", result)
    ctx.summary = f"transformers' continuous batching on std-32: {result['output_tok_per_s']} tok/s"
    kvferry = _serve_tok_per_s(ctx)
    if kvferry:
        ctx.record("kvferry_speedup", round(kvferry / result["output_tok_per_s"], 2))
        ctx.summary += f"; kvferry's stack (serve) {kvferry} tok/s: {ctx.findings['kvferry_speedup']}x"


def _serve_tok_per_s(ctx: Context) -> float | None:
    """The serve part's throughput, from its result file in the work folder, where it ran in this run."""
    try:
        found = json.loads((ctx.work / "serve.json").read_text())
        return float(found["findings"]["bench_serve"]["kvferry"]["output_tok_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
