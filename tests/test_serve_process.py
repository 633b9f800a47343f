"""Chapter 13: the engine core in a process of its own (``AsyncLLM(engine_core_process=True)``,
vLLM's ``EngineCoreProc``), against the offline engine and the thread it replaces.

The engine is built in a spawned process; the caller's side talks to it through a pipe, so the
functions sent with ``call_in_engine_thread`` are defined at module level here (they must pickle).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from course_pkg.engine import LLM
from course_pkg.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestOutputKind
from course_pkg.sampling_params import SamplingParams
from course_pkg.serve import ServerThread, build_app
from tests.helpers import run_in_fresh_loop

CONFIG = dict(device="cpu", num_kvcache_blocks=256, block_size=16)
NAME = "course-tiny"
PROMPTS = ["The block manager", "A prefix cache hit", "Paged attention reads", "The scheduler admits"]


def pool_state(engine, live) -> tuple[int, int, bool]:   # runs in the engine's process
    return len(engine.block_manager.free_block_ids), engine.block_manager.num_blocks, engine.has_unfinished_requests()


def engine_pid(engine, live) -> int:
    return os.getpid()


def wait_idle(llm: AsyncLLM, timeout: float = 20.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        free, total, busy = llm.call_in_engine_thread(pool_state)
        if not busy or time.monotonic() > deadline:
            return free, total
        time.sleep(0.02)


@pytest.fixture(scope="module")
def offline(one_torch_thread):
    return LLM(**CONFIG)


@pytest.fixture(scope="module")
def served(one_torch_thread):
    llm = AsyncLLM(**CONFIG, engine_core_process=True)
    server = ServerThread(build_app(llm)).start()
    yield llm, server
    server.stop()
    llm.shutdown()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_engine_runs_in_another_process(served):
    llm, _ = served
    assert llm.engine is None
    assert llm.call_in_engine_thread(engine_pid) != os.getpid()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=10),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10)],
                         ids=["greedy", "seeded"])
def test_completions_and_streams_equal_offline_generate(client, offline, params):
    want = offline.generate(PROMPTS, params, use_tqdm=False)
    kw = dict(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
              **({"seed": params.seed} if params.seed is not None else {}))
    for prompt, ref in zip(PROMPTS, want):
        got = client.completions.create(model=NAME, prompt=prompt, logprobs=0,
                                        extra_body={"return_tokens_as_token_ids": True}, **kw)
        assert [int(t.removeprefix("token_id:")) for t in got.choices[0].logprobs.tokens] == ref.token_ids
        assert got.choices[0].text == ref.text
        assert sum(got.choices[0].logprobs.token_logprobs) == pytest.approx(ref.outputs[0].cumulative_logprob,
                                                                             abs=1e-4)
        chunks = [c for c in client.completions.create(model=NAME, prompt=prompt, stream=True, **kw) if c.choices]
        assert len(chunks) >= 2 and "".join(c.choices[0].text for c in chunks) == ref.text


def test_n_2_and_a_stop_string(client, offline):
    params = SamplingParams(temperature=1.5, seed=5, n=2, max_tokens=8)
    want = offline.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=1.5, seed=5, n=2)
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    greedy = offline.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)[0]
    stop = greedy.text[len(greedy.text) // 2:len(greedy.text) // 2 + 3]
    got = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == greedy.text[:greedy.text.index(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_a_client_leaving_mid_stream_frees_the_blocks_in_the_engine_process(served):
    llm, server = served
    body = {"prompt": "Blocks", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break
    free, total = wait_idle(llm)
    assert free == total == CONFIG["num_kvcache_blocks"]


def test_bad_requests_and_what_needs_the_engine_thread_are_refused_clearly(served):
    llm, server = served
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [10 ** 9], "max_tokens": 2})
    assert r.status_code == 400 and "vocab" in r.json()["error"]["message"]
    assert "vllm:num_requests_running" in httpx.get(server.url + "/metrics").text
    r = httpx.get(server.url + "/dashboard/events")
    assert r.status_code == 501 and "--engine-core-process" in r.json()["error"]["message"]
    with pytest.raises(RuntimeError, match="engine_core_process"):
        llm.add_step_listener(lambda engine, live: None)
    with pytest.raises(TypeError, match="pickle"):
        llm.call_in_engine_thread(lambda engine, live: 1)
    with pytest.raises(ValueError, match="engine="):
        AsyncLLM(engine=object(), engine_core_process=True)
    with pytest.raises(ValueError, match="num_kvcache_blocks"):   # raised in the engine's process, re-raised here
        AsyncLLM(device="cpu", num_kvcache_blocks=-1, engine_core_process=True)
    assert llm.is_running


def test_admission_control_in_the_engine_process(one_torch_thread):
    llm = AsyncLLM(device="cpu", num_kvcache_blocks=128, max_num_seqs=1, max_waiting=1, engine_core_process=True)
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main():
        first = await llm.add_request("Burst 0", long)    # runs
        second = await llm.add_request("Burst 1", long)   # waits (1 <= max_waiting)
        with pytest.raises(QueueFullError):
            await llm.add_request("Burst 2", long)
        for state in (first, second):
            llm.abort_state(state)
    try:
        run_in_fresh_loop(main())
        assert wait_idle(llm)[0] == 128
    finally:
        llm.shutdown()


def test_shutdown_and_a_dead_engine_process_fail_requests_in_flight_clearly(one_torch_thread):
    for how in ("shutdown", "killed"):
        llm = AsyncLLM(device="cpu", num_kvcache_blocks=80, engine_core_process=True)
        pid = llm.call_in_engine_thread(engine_pid)

        async def main():
            gen = llm.generate("Blocks", SamplingParams(max_tokens=1000, ignore_eos=True),
                               output_kind=RequestOutputKind.DELTA)
            await anext(gen)
            if how == "shutdown":
                await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
            else:
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="shut down" if how == "shutdown" else "exited"):
                async for _ in gen:
                    pass
            with pytest.raises(EngineDeadError):
                await llm.add_request("Blocks")
        try:
            run_in_fresh_loop(main())
            assert not llm.is_running
        finally:
            llm.shutdown()


def test_a_call_the_engine_process_cannot_unpickle_fails_alone(served, monkeypatch):
    """A function defined in a notebook or a script lives in ``__main__``: it pickles here by
    name, and the spawned engine process has no such name. The call fails; the engine serves on."""
    import sys

    def orphan(engine, live):
        return 1
    orphan.__module__, orphan.__qualname__ = "__main__", "course_test_orphan"
    monkeypatch.setattr(sys.modules["__main__"], "course_test_orphan", orphan, raising=False)
    llm, server = served
    with pytest.raises(AttributeError, match="course_test_orphan"):
        llm.call_in_engine_thread(orphan, timeout=10)
    assert llm.is_running
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Blocks", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_request_id_is_free_again_at_once_and_an_unpicklable_prompt_is_refused(served):
    llm, _ = served
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def main():
        gen = llm.generate("Blocks", params, request_id="A", output_kind=RequestOutputKind.DELTA)
        await anext(gen)
        await gen.aclose()   # the abort is on its way to the engine process
        again = [out async for out in llm.generate("Blocks", SamplingParams(temperature=0.0, max_tokens=4),
                                                   request_id="A")]
        with pytest.raises(Exception, match="pickle"):
            await llm.add_request({"prompt": "Blocks", "cache_salt": lambda: 1}, request_id="B")
        after = [out async for out in llm.generate("Blocks", SamplingParams(max_tokens=2), request_id="B")]
        return again[-1], after[-1]
    again, after = run_in_fresh_loop(main())
    assert again.finished and len(again.outputs[0].token_ids) == 4
    assert after.finished and len(after.outputs[0].token_ids) == 2
    assert wait_idle(llm)[0] == CONFIG["num_kvcache_blocks"]
