"""The GPU check: everything that needs a CUDA device, in one run of at most 7.5 minutes on one H100.

`scripts/gpu_check.sh OUTDIR` (`make gpu-check OUT=OUTDIR`) runs it on the GPU machine's own Python from the
source tree; `kvferry gpu-check OUTDIR` runs the same driver where kvferry is installed. The driver
(driver.py) runs each part (parts.py names them) in a process of its own under its own timeout and rewrites
OUTDIR/report.json and report.txt after each one, so that a run cut off still leaves what it got.

KVFERRY_GPU_CHECK_ALLOW_CPU=1 runs every part on the CPU with a tiny model, under the Triton interpreter: it is
for testing this script's plumbing only, and measures nothing.

Why a driver of its own and not pytest with markers and pytest-timeout (issue 40, part 4; pytest, pytest-timeout
and pytest-xdist are in the GPU image, so the question is what they do, not whether they are there). The kernel
tests part does run pytest: they are pass/fail tests. For the run as a whole, pytest lacks or cannot guarantee:
- A timeout that frees the GPU. A part starts a stack (gateway, prefill and decode processes on the GPU); the driver
  kills the part's whole process group and goes on to the next part. pytest-timeout's signal method raises in the
  main thread only when it runs Python again, never inside a hung CUDA call or a blocking read, and leaves the
  part's children running; its thread method os._exit()s pytest itself, ending every later part.
- A report that survives. The driver rewrites report.json and report.txt after every part, so a run cut off at the
  device call's limit still brings back what it measured; pytest's junit XML is written at the session's end.
- Time carried over. Each part gets its own timeout plus what the parts before it left unused, clipped to one
  deadline counted from scripts/gpu_check.sh's start (BUDGET_S); pytest-timeout's timeouts are fixed per test.
- A process per part. A CUDA fault (an illegal address) poisons the process's CUDA context for what runs after it;
  pytest runs its tests in one process (xdist reuses its workers, and forking after CUDA is set up is unsafe).
- Figures, not only outcomes: each part records findings (the report's figures, docs/benchmarks.md), skips the
  parts that need the model when it failed, and the exit status says 2 where there is no GPU.
Each of these could be rebuilt in a conftest.py around subprocesses, but that is this driver again, and whether
pytest-timeout's methods behave as needed on the device's own Python 3.12 could only be checked there.
"""
