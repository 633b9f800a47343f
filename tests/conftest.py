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


@pytest.fixture(scope="module")
def hf_model():
    """The shipped tiny model in Hugging Face transformers, the oracle; float32 on the CPU, and no
    end-of-sequence token, so that generations have the lengths asked for (compare with ignore_eos)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from course_pkg.models import default_model_path
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(autouse=True)
def _sigint_raises_keyboard_interrupt():
    """The tests that send SIGINT expect Python's own handler (KeyboardInterrupt). A runner started
    in the background of a non-interactive shell inherits SIGINT ignored (POSIX), and Python then
    installs no handler; put it in place for the test and restore what was there."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
