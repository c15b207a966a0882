import os

import pytest
import torch

# Without CUDA the Triton kernels run on the CPU through the interpreter; with it, the compiled kernels (and CUDA
# graph capture, which the interpreter cannot do) are what must be tested. Triton reads the setting when a kernel
# is defined, so it is chosen here, before any test module imports one; spawned workers inherit it. A value set
# by the user wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("KVFERRY_TEST_THREADS", "2")))


@pytest.fixture(scope="session", autouse=True)
def _no_prepared_weights_left_behind():
    """The int8 tests prepare their tiny models' weights in the user's cache (common/model/prepared_weights.py), each
    under a temporary folder's name: the files this session made go with it, or they would pile up run after run."""
    from kvferry.common.model_files import cache_root

    folder = cache_root() / "prepared"
    before = set(folder.iterdir()) if folder.is_dir() else set()
    yield
    if folder.is_dir():
        for path in set(folder.iterdir()) - before:
            path.unlink(missing_ok=True)
