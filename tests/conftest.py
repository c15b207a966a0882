import os

import torch

# Without CUDA the Triton kernels run on the CPU through the interpreter; with it, the compiled kernels (and CUDA
# graph capture, which the interpreter cannot do) are what must be tested. Triton reads the setting when a kernel
# is defined, so it is chosen here, before any test module imports one; spawned workers inherit it. A value set
# by the user wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("KVFERRY_TEST_THREADS", "2")))
