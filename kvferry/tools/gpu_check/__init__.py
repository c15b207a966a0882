"""The GPU check: everything that needs a CUDA device, in one run of at most 7.5 minutes on one H100.

`scripts/gpu_check.sh OUTDIR` (`make gpu-check OUT=OUTDIR`) runs it on the GPU machine's own Python from the
source tree; `kvferry gpu-check OUTDIR` runs the same driver where kvferry is installed. The driver
(driver.py) runs each part (parts.py names them) in a process of its own under its own timeout and rewrites
OUTDIR/report.json and report.txt after each one, so that a run cut off still leaves what it got.

KVFERRY_GPU_CHECK_ALLOW_CPU=1 runs every part on the CPU with a tiny model, under the Triton interpreter: it is
for testing this script's plumbing only, and measures nothing.
"""
