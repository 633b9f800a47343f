"""Run by tests/test_tensor_parallel.py in a fresh interpreter: the life cycle of tensor-parallel
LLMs in one process, printed line by line for the test to read (``PIDS``, ``ALIVE``, ``ERROR``)."""
import os
import sys

import torch

from course_pkg import LLM, SamplingParams

SETTINGS = dict(device="cpu", dtype=torch.float32, tensor_parallel_size=2, block_size=8, num_kvcache_blocks=64,
                attention_backend="torch")
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def alive(pids):
    return [os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z" for p in pids]


def say(*words):
    print(*words, flush=True)


def main(mode: str) -> None:
    torch.set_num_threads(1)
    if mode == "kill":                           # rank 0 dies without any clean-up
        llm = LLM(**SETTINGS)
        say("PIDS", *llm.model_runner.worker_pids)
        os.kill(os.getpid(), 9)
    with LLM(**SETTINGS) as llm:                 # 1. a context manager closes it
        pids = llm.model_runner.worker_pids
        say("PIDS", *pids)
        say("TOKENS", *llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].token_ids)
    say("ALIVE after with", *alive(pids))
    say("EXITCODES", *(p.exitcode for p in llm.model_runner.processes))

    llm = LLM(**SETTINGS)                        # 2. a step interrupted half-way, then close()
    pids = llm.model_runner.worker_pids
    say("PIDS", *pids)
    compute_logits = llm.model.compute_logits

    def interrupted(hidden):                     # the workers are already inside this step
        raise KeyboardInterrupt

    llm.model.compute_logits = interrupted
    try:
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
    except KeyboardInterrupt:
        say("INTERRUPTED")
    llm.model.compute_logits = compute_logits
    try:
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
    except RuntimeError as e:
        say("ERROR", e)
    llm.close()
    llm.close()                                  # twice is fine
    say("ALIVE after close", *alive(pids))
    try:                                         # a closed LLM takes no request, and holds no block
        llm.add_request([5, 6, 7], PARAMS)
    except RuntimeError as e:
        say("CLOSED", e, "free", llm.block_manager.num_free_blocks == llm.block_manager.num_blocks,
            "queued", len(llm.scheduler.waiting))

    llm = LLM(**SETTINGS)                        # 3. a new group in the same process; never closed
    say("PIDS", *llm.model_runner.worker_pids)
    say("TOKENS", *llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].token_ids)
    say("EXIT without close")


if __name__ == "__main__":
    main(sys.argv[1])
