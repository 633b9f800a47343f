import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton reads TRITON_INTERPRET when it is first imported, and transformers or torch's compiler
# may import it before any course_pkg module gets the chance: decide here, before any test
# module is imported, that a machine without CUDA runs the kernels under the interpreter.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny models gain nothing from threads: with several, OpenMP start-up dominates every
    op, and on a loaded 2-core machine 2 threads made the engine's steps 30x slower (they wait
    for each other). Modules that run models use it; the thread count is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
