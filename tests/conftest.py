import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton reads TRITON_INTERPRET when it is first imported, and transformers or torch's compiler
# may import it before any course_pkg module gets the chance: decide here, before any test
# module is imported, that a machine without CUDA runs the kernels under the interpreter.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
