"""The GPU check: everything that needs a CUDA device, in one run of at most 7.5 minutes on one H100.

`scripts/gpu_check.sh OUTDIR` (`make gpu-check OUT=OUTDIR`) runs it on the GPU machine's own Python from the source
tree; `kvferry gpu-check OUTDIR` runs the same driver where kvferry is installed. The driver (driver.py) runs each
part (parts.py) in a process of its own under its own timeout, and rewrites OUTDIR/report.json and report.txt after
each. KVFERRY_GPU_CHECK_ALLOW_CPU=1 runs every part on the CPU with a tiny model under the Triton interpreter: it
tests the plumbing and measures nothing.

Why a driver of its own and not pytest with pytest-timeout (issue 40; docs/benchmarks.md has the whole case): a
timeout must kill the part's whole process group (a stack holds the GPU) and let the next part run, which neither
of pytest-timeout's methods does; the report must survive a run cut off at the device call's limit (junit XML is
written at the end); a part gets the time the parts before it left unused, under one deadline; and each part needs
a process of its own, since a CUDA fault poisons its process. The kernel tests part does run pytest.
"""
