"""The cost model's contention: how much a worker's steps slow down beside busy processes on the same cores.

For each pair of thread counts (the worker's, a competitor's), a decode and a prefill step are timed alone, then
beside one and two processes multiplying matrices without pause. Each load (busy threads per core) keeps the mean
slowdown of the two steps; the simulator interpolates between the loads.
"""

import contextlib
import subprocess
import sys
import time

COMPETITOR = (
    "import sys, torch\n"
    "torch.set_num_threads(int(sys.argv[1]))\n"
    "a = torch.randn(512, 512)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    a = (a @ a).clamp_(-1, 1)\n"
)
DECODE_POINT = (8, 256)  # batch, context: a typical decode step
PREFILL_POINT = (128, 0, 1)  # tokens, offset, prompts
COMPETITORS = (1, 2)  # busy processes beside the worker


@contextlib.contextmanager
def _competitors(k: int, threads: int):
    command = [sys.executable, "-c", COMPETITOR, str(threads)]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(k)]
    try:
        for proc in procs:
            proc.stdout.readline()  # "ready": torch imported, the loop starts
        time.sleep(0.2)
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _times(bench, threads: int) -> tuple[float, float]:
    decode = bench.decode_point(threads, *DECODE_POINT).seconds
    prefill = bench.prefill_point(threads, *PREFILL_POINT).seconds
    return decode, prefill


def measure_contention(bench, threads: list[int], cores: int, progress) -> tuple[dict[str, list], list[dict]]:
    """("own/competitor's threads" -> [[busy threads per core, slowdown], ...], the rows measured). bench: a
    StepBench (costs.py)."""
    import torch

    fitted, rows = {}, []
    for own in threads:
        torch.set_num_threads(own)
        alone = _times(bench, own)
        for width in threads:
            samples = []
            for k in COMPETITORS:
                with _competitors(k, width):
                    shared = _times(bench, own)
                busy = (own + k * width) / cores
                for kind, base, now in zip(("decode", "prefill"), alone, shared):
                    row = {"threads": own, "competitor_threads": width, "competitors": k, "kind": kind}
                    rows.append({**row, "busy_per_core": busy, "slowdown": now / base})
                if busy > 1:
                    samples.append([busy, (shared[0] / alone[0] + shared[1] / alone[1]) / 2])
                progress(
                    f"[{own} threads] beside {k} busy processes of {width} thread(s): "
                    f"decode x{shared[0] / alone[0]:.2f}, prefill x{shared[1] / alone[1]:.2f}"
                )
            if samples:
                fitted[f"{own}/{width}"] = sorted(samples)
    return fitted, rows
