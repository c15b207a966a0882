"""launcher.child_setup, which every child of serve, of `kvferry gateway --gateways N` and of the gateway bench runs
between fork and exec: a real child gets SIGTERM as its parent-death signal and the CPUs it was given, and one that
finds another parent than the one named (its own died before the prctl, and it was re-parented) ends before it runs."""

import os
import signal
import subprocess
import sys

import pytest

from kvferry.services.launcher import child_setup

REPORT = (
    "import ctypes, os, signal; sig = ctypes.c_int(); "
    "ctypes.CDLL(None).prctl(2, ctypes.byref(sig)); "  # PR_GET_PDEATHSIG
    "print(sig.value, sorted(os.sched_getaffinity(0)))"
)


@pytest.mark.skipif(sys.platform != "linux", reason="a parent-death signal is Linux's")
def test_a_child_gets_sigterm_when_its_parent_dies_and_its_cpus():
    cpu = min(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", REPORT], capture_output=True, text=True, preexec_fn=child_setup(os.getpid(), cpus={cpu})
    )
    assert done.stdout.split(maxsplit=1) == [str(int(signal.SIGTERM)), f"[{cpu}]\n"], done.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="a parent-death signal is Linux's")
def test_a_child_whose_parent_is_not_the_one_named_ends_before_it_runs():
    done = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True,
                          preexec_fn=child_setup(os.getppid()))  # fmt: skip
    assert (done.returncode, done.stdout) == (1, "")
