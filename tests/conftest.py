import os

# The Triton kernels run on the CPU through the interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("KVFERRY_TEST_THREADS", "2")))
