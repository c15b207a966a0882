"""The GPU check: everything that needs a CUDA device, in one run of at most 7.5 minutes on one H100.

`scripts/gpu_check.sh OUTDIR` (`make gpu-check OUT=OUTDIR`) runs it on the GPU machine's own Python from the source
tree; `kvferry gpu-check OUTDIR` runs the same driver where kvferry is installed. The driver (driver.py) runs each
part (parts.py) in a process of its own under its own timeout, and rewrites OUTDIR/report.json and report.txt after
each. KVFERRY_GPU_CHECK_ALLOW_CPU=1 runs every part on the CPU with a tiny model under the Triton interpreter: it
tests the plumbing and measures nothing.

Why a driver of its own, not pytest with pytest-timeout (issue 40; docs/benchmarks.md). The kernel tests part runs
pytest, but the run as a whole needs:
- A timeout that frees the GPU: the part's whole process group (a stack's gateway and workers) is killed and the
  next part runs. pytest-timeout's signal method cannot interrupt a hung CUDA call or a blocking read and leaves
  children running; its thread method os._exit()s pytest, ending every later part.
- A report that survives a run cut off at the device call's limit; pytest's junit XML is written at the end.
- Time carried over: a part gets what the parts before it left unused, under one deadline from the script's start.
- A process per part: a CUDA fault poisons its process's context (xdist reuses its workers).
- Figures, not only outcomes, parts skipped when the model failed, and exit status 2 where there is no GPU.
Rebuilding these in a conftest.py around subprocesses would be this driver again.
"""
