"""Chapter 13: AsyncLLM and the OpenAI-compatible server, driven by the real ``openai`` client.

The reference is the offline engine: ``LLM.generate`` on the same prompts and sampling params,
in another engine with the same configuration. The server runs in a thread of this process on
a free port (``ServerThread``); one test starts ``python -m course_pkg.serve`` as a process.
Token ids are compared exactly through vLLM's ``return_tokens_as_token_ids`` (the logprobs then
name each token ``token_id:<id>``).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from course_pkg.engine import LLM
from course_pkg.engine.async_llm import AsyncLLM, EngineDeadError, EngineGenerateError, RequestOutputKind
from course_pkg.models import default_model_path
from course_pkg.sampling_params import SamplingParams
from course_pkg.serve import ServerThread, build_app
from tests.helpers import run_in_fresh_loop


ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(device="cpu", num_kvcache_blocks=256, block_size=16)
NAME = "course-tiny"
PROMPTS = ["The block manager", "A prefix cache hit", "Paged attention reads", "The scheduler admits",
           "Copy on write", "The free queue"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10)


@pytest.fixture(scope="module")
def offline(one_torch_thread):
    return LLM(**CONFIG)


@pytest.fixture(scope="module")
def served(one_torch_thread):
    llm = AsyncLLM(**CONFIG)
    server = ServerThread(build_app(llm)).start()
    yield llm, server
    server.stop()
    llm.shutdown()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(offline, prompts, params):
    return offline.generate(prompts, params, use_tqdm=False)


def token_ids(logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def wait_idle(llm: AsyncLLM, timeout: float = 20.0) -> tuple[int, int]:
    """Wait until the engine holds no request; returns (free blocks, all blocks)."""
    deadline = time.monotonic() + timeout
    while True:
        free, total, busy = llm.call_in_engine_thread(
            lambda e, live: (len(e.block_manager.free_block_ids), e.block_manager.num_blocks,
                             e.has_unfinished_requests()))
        if not busy or time.monotonic() > deadline:
            return free, total
        time.sleep(0.02)


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def api_kwargs(params: SamplingParams) -> dict:
    kw = dict(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, n=params.n)
    if params.seed is not None:
        kw["seed"] = params.seed
    return kw


# ------------------------------------------------------------------ completions vs LLM.generate

@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_completions_equal_offline_generate_token_for_token(client, offline, params):
    want = reference(offline, PROMPTS, params)
    for prompt, ref in zip(PROMPTS, want):
        got = client.completions.create(model=NAME, prompt=prompt, logprobs=0, extra_body={
            "return_tokens_as_token_ids": True}, **api_kwargs(params))
        choice = got.choices[0]
        assert token_ids(choice.logprobs) == ref.token_ids
        assert choice.text == ref.text
        assert choice.finish_reason == ref.finish_reason
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-4)
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert got.usage.completion_tokens == len(ref.token_ids)


def test_prompt_as_token_ids_and_cached_tokens(client, offline):
    ids = offline.tokenizer.encode("The block manager keeps four structures and two guards for "
                                   "every block it owns", add_special_tokens=False)
    assert len(ids) > 16   # one full block at least: the second request finds it in the cache
    ref = reference(offline, [ids], GREEDY)[0]
    first = client.completions.create(model=NAME, prompt=ids, **api_kwargs(GREEDY))
    again = client.completions.create(model=NAME, prompt=ids, **api_kwargs(GREEDY))
    assert first.choices[0].text == again.choices[0].text == ref.text
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16


def test_cache_salt_shares_cached_blocks_only_within_one_salt(client, offline):
    ids = list(range(200, 240))   # 40 tokens: two full blocks a later request could hit
    ref = reference(offline, [ids], GREEDY)[0]

    def cached(salt=None):
        got = client.completions.create(model=NAME, prompt=ids, extra_body={} if salt is None else {"cache_salt": salt},
                                        **api_kwargs(GREEDY))
        assert got.choices[0].text == ref.text   # a salt changes what is shared, never the tokens
        return got.usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("bob") == 0          # same tokens, another salt: no hit
    assert cached() == 0               # no salt is a salt of its own
    assert cached("alice") == 32       # the same salt shares both full blocks
    assert cached() == 32
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_streamed_chunks_concatenate_to_the_offline_completion(client, offline, params):
    ref = reference(offline, PROMPTS[:3], params)
    for prompt, want in zip(PROMPTS[:3], ref):
        stream = client.completions.create(model=NAME, prompt=prompt, stream=True, logprobs=0,
                                           stream_options={"include_usage": True},
                                           extra_body={"return_tokens_as_token_ids": True}, **api_kwargs(params))
        chunks = list(stream)
        text_chunks = [c for c in chunks if c.choices]
        assert len(text_chunks) >= 2, "a stream of one chunk streams nothing"
        assert "".join(c.choices[0].text for c in text_chunks) == want.text
        assert [t for c in text_chunks for t in token_ids(c.choices[0].logprobs)] == want.token_ids
        reasons = [c.choices[0].finish_reason for c in text_chunks]
        assert reasons == [None] * (len(text_chunks) - 1) + [want.finish_reason]
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_n_2_gives_the_two_offline_completions(client, offline):
    params = SamplingParams(temperature=1.5, seed=5, n=2, max_tokens=8)
    want = reference(offline, [PROMPTS[0]], params)[0]
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], **api_kwargs(params))
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert want.outputs[0].text != want.outputs[1].text   # the test can tell the two apart
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], stream=True, **api_kwargs(params))
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [o.text for o in want.outputs]


def test_stop_strings_cut_the_offline_text(client, offline):
    want = reference(offline, [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    stop = want.text[len(want.text) // 2:len(want.text) // 2 + 3]
    assert stop.strip(), want.text
    cut = want.text[:want.text.index(stop)]
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0.0, stop=[stop, "\u2603"],
              extra_body={"ignore_eos": True})
    got = client.completions.create(**kw)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (cut, "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == cut


def test_chat_renders_the_template_and_equals_offline(client, offline):
    messages = [{"role": "system", "content": "You manage blocks."}, {"role": "user", "content": "Free one."}]
    text = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("assistant:") and "user: Free one." in text
    want = reference(offline, [text], SamplingParams(temperature=0.0, max_tokens=12))[0]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0.0)
    assert got.object == "chat.completion"
    assert (got.choices[0].message.role, got.choices[0].message.content) == ("assistant", want.text)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0.0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_models_health_and_metrics(client, served):
    llm, server = served
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    before = metric(server, "vllm:generation_tokens_total")
    got = client.completions.create(model=NAME, prompt="Blocks", max_tokens=7, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 7
    assert metric(server, "vllm:generation_tokens_total") == before + 7
    assert metric(server, "vllm:num_requests_running") == 0


# ------------------------------------------------------------------ errors

def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    for word in words:
        assert word in error["message"], error["message"]


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", "{not json", 400, ["not valid JSON"]),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 1.0}, 400, ["unknown field", "presence_penalty"]),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, 400, ["unknown field", "frequency_penalty"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1}}, 400,
     ["unknown field", "logit_bias"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, ["max_tokens"]),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, ["temperature"]),
    ("/v1/completions", {"max_tokens": 3}, 400, ["prompt", "required"]),
    ("/v1/completions", {"prompt": [5] * 2048}, 400, ["context length", "2048"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4000}, 400, ["context length", "4000"]),
    ("/v1/completions", {"prompt": [1, 2, 5000]}, 400, ["5000", "vocabulary"]),
    ("/v1/completions", {"prompt": ""}, 400, ["empty"]),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, 400, ["logprobs"]),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, ["gpt-4"]),
    ("/v1/chat/completions", {"messages": []}, 400, ["messages"]),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, ["role"]),
    ("/v1/nothing-here", {}, 404, []),
])
def test_bad_requests_get_their_status_in_openai_shape(served, path, body, status, words):
    llm, server = served
    assert_openai_error(post(server, path, body), status, *words)
    assert wait_idle(llm)[0] == CONFIG["num_kvcache_blocks"]   # nothing was queued, no block taken


def test_the_openai_client_raises_its_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        client.completions.create(model=NAME, prompt="x", extra_body={"best_of": 2})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


def test_a_model_without_chat_template_refuses_chat_clearly(tmp_path, one_torch_thread):
    folder = tmp_path / "tiny-no-template"
    shutil.copytree(default_model_path(), folder)
    (folder / "chat_template.jinja").unlink()
    llm = AsyncLLM(folder, device="cpu", num_kvcache_blocks=16)
    try:
        with ServerThread(build_app(llm)) as server:
            r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
            assert_openai_error(r, 400, "no chat template", "/v1/completions")
            ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})   # completions still work
            assert ok.status_code == 200
    finally:
        llm.shutdown()


def test_a_full_waiting_queue_is_a_503(one_torch_thread):
    llm = AsyncLLM(device="cpu", num_kvcache_blocks=64, max_num_seqs=1, max_waiting=2)
    try:
        with ServerThread(build_app(llm)) as server:
            async def scenario():
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                    long = {"prompt": "Blocks", "max_tokens": 400, "ignore_eos": True, "stream": True}
                    async with http.stream("POST", "/v1/completions", json=long) as running:
                        lines = running.aiter_lines()
                        while not (await anext(lines)).startswith("data:"):
                            pass   # the first token: the long request runs, and holds the one seat
                        waiters = [asyncio.ensure_future(http.post("/v1/completions", json={
                            "prompt": f"Waiter {i}", "max_tokens": 2})) for i in range(2)]
                        deadline = time.monotonic() + 30
                        while metric(server, "vllm:num_requests_waiting") < 2:
                            assert time.monotonic() < deadline, "the two waiters never queued"
                            await asyncio.sleep(0.01)
                        refused = await http.post("/v1/completions", json={"prompt": "One more", "max_tokens": 2})
                        assert_openai_error(refused, 503, "waiting queue is full")
                        assert refused.json()["error"]["code"] == "queue_full"
                    # leaving the stream aborts the long request: the two waiters run and finish
                    done = await asyncio.gather(*waiters)
                    assert [r.status_code for r in done] == [200, 200]
            run_in_fresh_loop(scenario())
            assert wait_idle(llm)[0] == 64
    finally:
        llm.shutdown()


# ------------------------------------------------------------------ aborts, faults, shutdown

def test_a_client_leaving_mid_stream_aborts_its_request(served):
    llm, server = served
    steps = llm.engine.num_steps
    body = {"prompt": "Blocks", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break
    free, total = wait_idle(llm)
    assert free == total, "the aborted request still holds blocks"
    assert metric(server, "vllm:num_requests_running") == 0
    assert llm.engine.num_steps - steps < 300   # it was stopped early, not run to its end


def test_a_client_leaving_a_whole_completion_aborts_it(served):
    llm, server = served
    steps = llm.engine.num_steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.5,
                   json={"prompt": "Blocks", "max_tokens": 1500, "ignore_eos": True})
    free, total = wait_idle(llm)
    assert free == total
    assert llm.engine.num_steps - steps < 1500   # aborted when the client left, not run to its end


class FlakyRunner:
    """Wraps ``execute_model``: raises at the listed calls, or whenever ``poison`` is in the batch."""

    def __init__(self, runner, fail_at=(), poison: int | None = None):
        self.runner, self.original = runner, runner.execute_model
        self.fail_at, self.poison, self.calls, self.raised = set(fail_at), poison, 0, 0

    def __call__(self, out):
        self.calls += 1
        poisoned = self.poison is not None and any(self.poison in s.prompt_token_ids for s in out.seqs)
        if self.calls in self.fail_at or poisoned:
            self.raised += 1
            bs = self.runner.block_size   # as if the forward pass had begun writing K/V
            self.runner._note_written((s.block_table[p // bs], p % bs) for s, c, n in
                                      zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens)
                                      for p in range(c, c + n))
            raise RuntimeError("injected fault in the forward pass")
        return self.original(out)

    def __enter__(self):
        self.runner.execute_model = self
        return self

    def __exit__(self, *exc):
        del self.runner.execute_model


def run_all(llm: AsyncLLM, prompts, params):
    async def one(p):
        try:
            return [o async for o in llm.generate(p, params)][-1]
        except Exception as e:
            return e

    async def main():
        return await asyncio.gather(*[one(p) for p in prompts])
    return run_in_fresh_loop(main())


def test_a_transient_step_fault_is_rolled_back_and_costs_no_request(offline, one_torch_thread):
    llm = AsyncLLM(**CONFIG)
    try:
        want = reference(offline, PROMPTS, SEEDED)
        with FlakyRunner(llm.engine.model_runner, fail_at={1, 4, 9}) as flaky:
            got = run_all(llm, PROMPTS, SEEDED)
        assert flaky.raised == 3 and llm.num_step_faults == 3
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert wait_idle(llm)[0] == CONFIG["num_kvcache_blocks"]
    finally:
        llm.shutdown()


def test_a_persistent_fault_fails_only_the_requests_of_its_step(offline, one_torch_thread):
    llm = AsyncLLM(**CONFIG, max_num_seqs=2)
    try:
        poison_prompt = [7, 7, 7, 900]
        prompts = PROMPTS[:4] + [poison_prompt]
        want = reference(offline, PROMPTS[:4], GREEDY)
        with FlakyRunner(llm.engine.model_runner, poison=900):
            got = run_all(llm, prompts, GREEDY)
            after = run_all(llm, PROMPTS[:2], GREEDY)   # the loop lives on
        assert isinstance(got[-1], EngineGenerateError) and "injected fault" in str(got[-1])
        ok = [g for g in got[:4] if not isinstance(g, Exception)]
        assert len(ok) >= 3   # max_num_seqs=2: the poisoned step held one other request at most
        for g, w in zip(got[:4], want):
            if not isinstance(g, Exception):
                assert g.token_ids == w.token_ids
        assert [a.token_ids for a in after] == [w.token_ids for w in want[:2]]
        assert wait_idle(llm)[0] == CONFIG["num_kvcache_blocks"]
    finally:
        llm.shutdown()


def test_a_step_that_keeps_failing_is_a_500_in_openai_shape_and_the_server_lives_on(served):
    llm, server = served
    with FlakyRunner(llm.engine.model_runner, poison=900):
        whole = post(server, "/v1/completions", {"prompt": [7, 7, 900], "max_tokens": 3})
        assert_openai_error(whole, 500, "injected fault", "aborted")
        assert whole.json()["error"]["code"] == "engine_step_failed"
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"prompt": [8, 900], "max_tokens": 3, "stream": True}) as r:
            assert r.status_code == 200   # queued fine; the fault comes once the stream has begun
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[-2])["error"]["message"]
        fine = post(server, "/v1/completions", {"prompt": [7, 7, 8], "max_tokens": 3})
        assert fine.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert wait_idle(llm)[0] == CONFIG["num_kvcache_blocks"]


def test_shutdown_aborts_requests_in_flight_with_a_clear_error(one_torch_thread):
    llm = AsyncLLM(device="cpu", num_kvcache_blocks=80)

    async def main():
        gen = llm.generate("Blocks", SamplingParams(max_tokens=1000, ignore_eos=True),
                           output_kind=RequestOutputKind.DELTA)
        await anext(gen)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("Blocks")
    run_in_fresh_loop(main())
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.engine.block_manager.free_block_ids) == 80


def test_async_llm_output_kinds_and_cancellation(offline, one_torch_thread):
    llm = AsyncLLM(**CONFIG)
    try:
        want = reference(offline, [PROMPTS[2]], GREEDY)[0]

        async def main():
            outs = {k: [o async for o in llm.generate(PROMPTS[2], GREEDY, output_kind=k)] for k in RequestOutputKind}
            delta, cumulative, final = (outs[RequestOutputKind.DELTA], outs[RequestOutputKind.CUMULATIVE],
                                        outs[RequestOutputKind.FINAL_ONLY])
            assert len(final) == 1 and final[0].token_ids == want.token_ids and final[0].finished
            assert [t for o in delta for t in o.token_ids] == want.token_ids
            assert "".join(o.text for o in delta) == want.text
            assert [o.token_ids for o in cumulative] == [want.token_ids[:k + 1] for k in range(len(want.token_ids))]
            assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
            with pytest.raises(ValueError, match="empty"):
                await llm.add_request([])
            steps = llm.engine.num_steps
            task = asyncio.ensure_future(_consume(llm.generate("Blocks", SamplingParams(max_tokens=1500,
                                                                                        ignore_eos=True))))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return steps
        steps = run_in_fresh_loop(main())
        assert wait_idle(llm)[0] == CONFIG["num_kvcache_blocks"]
        assert llm.engine.num_steps - steps < 1500   # cancelled, not run to its end
    finally:
        llm.shutdown()


async def _consume(gen):
    async for _ in gen:
        pass


# ------------------------------------------------------------------ load

def test_64_streaming_clients_a_quarter_leaving(served, offline):
    """64 concurrent streams, 16 of them closed at a random point: every finished stream is its
    offline result (no token lost or duplicated), /health answers during the load, and afterwards
    every block is free and nothing runs."""
    llm, server = served
    rng = random.Random(13)
    prompts = [f"Request {i} asks the block manager" for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = reference(offline, prompts, params)
    leave_after = {i: rng.randint(1, 10) for i in rng.sample(range(64), 16)}

    async def stream(http, i):
        body = {"prompt": prompts[i], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}
        ids, text, chunks = [], "", 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                ids += [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
                text += choice["text"]
                chunks += 1
                if chunks == leave_after.get(i):
                    return None   # leaves mid-stream: closing the response drops the connection
        return ids, text

    async def health(http, stop: asyncio.Event, answers: list):
        while not stop.is_set():
            answers.append((await http.get("/health")).status_code)
            await asyncio.sleep(0.05)

    async def main():
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            stop, answers = asyncio.Event(), []
            pinger = asyncio.ensure_future(health(http, stop, answers))
            results = await asyncio.gather(*[stream(http, i) for i in range(64)])
            stop.set()
            await pinger
            return results, answers

    results, answers = run_in_fresh_loop(main())
    assert answers and set(answers) == {200}
    for i, result in enumerate(results):
        if i in leave_after:
            assert result is None
        else:
            assert result == (want[i].token_ids, want[i].text), f"stream {i}"
    free, total = wait_idle(llm)
    assert free == total
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:num_requests_waiting") == 0


# ------------------------------------------------------------------ the load client's arithmetic

def test_load_client_percentiles_and_arrivals_against_numpy():
    import numpy as np

    from course_pkg.serve.load import percentile, poisson_arrivals, scaled_arrivals

    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    times = poisson_arrivals(4000, 50.0, seed=1)
    assert times == sorted(times) and len(times) / times[-1] == pytest.approx(50.0, rel=0.05)
    scaled = scaled_arrivals([100, 100, 300, 1100], 4, rate=2.0)
    assert scaled == pytest.approx([0.0, 0.0, 0.3, 1.5])   # 3 gaps at 2 per second: 1.5 s, shape kept


# ------------------------------------------------------------------ the command line

@pytest.mark.parametrize("flags", [[], ["--engine-core-process"]], ids=["thread-core", "process-core"])
def test_python_m_course_pkg_serve_starts_and_answers(flags):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "course_pkg.serve", "--port", str(port),
                             "--num-kvcache-blocks", "32", *flags], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        got = client.completions.create(model=NAME, prompt="Blocks", max_tokens=3, extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 3
        children = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    finally:
        proc.terminate()
        proc.wait(30)
    # Stopping the server stops its engine core process too: nothing is left running.
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _proc_state(pid) for pid in children):
        assert time.monotonic() < deadline, f"processes {children} outlived the server"
        time.sleep(0.1)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


# ------------------------------------------------------------------ review fixes (admission, races, shapes)

def _hold_engine_thread(llm: AsyncLLM):
    """Park the engine thread on an event, so that the commands queued meanwhile run in one drain."""
    import threading
    gate = threading.Event()
    llm.call_in_engine_thread_nowait(lambda engine, live: gate.wait(30))
    return gate


def test_admission_counts_only_the_requests_waiting_beyond_free_seats(one_torch_thread):
    with pytest.raises(ValueError, match="max_waiting"):
        AsyncLLM(device="cpu", num_kvcache_blocks=16, max_waiting=0)
    llm = AsyncLLM(device="cpu", num_kvcache_blocks=128, max_num_seqs=4, max_waiting=1)
    long = SamplingParams(max_tokens=300, ignore_eos=True)

    async def main():
        gate = _hold_engine_thread(llm)
        # Six adds, all run before any step: four seats are free, so four of them do not wait;
        # the fifth waits (1 <= max_waiting); the sixth would be the second to wait: refused.
        adds = [asyncio.ensure_future(llm.add_request(f"Burst {i}", long)) for i in range(6)]
        await asyncio.sleep(0.05)
        gate.set()
        got = await asyncio.gather(*adds, return_exceptions=True)
        kinds = [type(g).__name__ for g in got]
        for g in got:
            if not isinstance(g, Exception):
                llm.abort_state(g)
        return kinds
    try:
        kinds = run_in_fresh_loop(main())
        assert kinds == ["RequestState"] * 5 + ["QueueFullError"], kinds
        assert wait_idle(llm)[0] == 128
    finally:
        llm.shutdown()


def test_an_add_racing_shutdown_is_refused_never_left_hanging(one_torch_thread, monkeypatch):
    import course_pkg.engine.async_llm as async_llm_module

    llm = AsyncLLM(device="cpu", num_kvcache_blocks=16)
    original = async_llm_module.RequestState

    class LateState(original):
        def __init__(self, *args, **kwargs):
            llm.shutdown()   # the loop stops (and drains its queue for the last time) right here
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(async_llm_module, "RequestState", LateState)

    async def main():
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(llm.add_request("Blocks"), timeout=5)
    run_in_fresh_loop(main())


def test_shutdown_never_closes_the_engine_under_a_running_step(one_torch_thread):
    import threading

    llm = AsyncLLM(device="cpu", num_kvcache_blocks=16)
    closed, release, in_step = [], threading.Event(), threading.Event()
    llm.engine.close = lambda: closed.append(True)
    runner = llm.engine.model_runner
    original = runner.execute_model

    def slow(out):
        in_step.set()
        release.wait(30)
        return original(out)

    runner.execute_model = slow

    async def main():
        gen = llm.generate("Blocks", SamplingParams(max_tokens=3), output_kind=RequestOutputKind.DELTA)
        task = asyncio.ensure_future(_consume(gen))
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 30)
        with pytest.raises(TimeoutError, match="still running"):
            llm.shutdown(timeout=0.1)
        assert not closed and not llm.is_running
        with pytest.raises(EngineDeadError):
            await llm.add_request("Blocks")   # refused at once while the step finishes
        release.set()
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDeadError):
            await task
    try:
        run_in_fresh_loop(main())
        assert closed == [True]
    finally:
        release.set()
        del runner.execute_model
        if not closed:
            llm.shutdown()


def test_the_load_client_counts_from_the_planned_arrival_and_reports_its_lag():
    from course_pkg.serve.load import RequestResult, _one

    class FakeStream:
        status_code = 200

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def aiter_lines(self):
            for text in ("a", "b"):
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": text, "logprobs": None}]})
            yield "data: [DONE]"

    class FakeHTTP:
        def stream(self, *args, **kwargs):
            return FakeStream()

    result = RequestResult(arrival=0.0)
    late_start = time.perf_counter() - 0.5   # the client gets to this request half a second late
    run_in_fresh_loop(_one(FakeHTTP(), {"prompt": "x"}, result, late_start))
    assert result.ok and result.num_tokens == 2
    assert 0.5 <= result.send_lag < 5
    assert result.ttft >= result.send_lag   # the user waited since the planned arrival, not since the send


def raw_post(server, path: str, content: str, method: str = "POST") -> httpx.Response:
    return httpx.request(method, server.url + path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("content, param, words", [
    ('{"prompt": "x", "temperature": -1}', "temperature", ["temperature"]),
    ('{"prompt": [1, 2, 5000]}', "prompt", ["5000", "vocabulary"]),
    ('{"prompt": [1, -2]}', "prompt", ["-2"]),
    ('{"prompt": "x", "seed": 9223372036854775808}', "seed", ["seed"]),
    ('{"prompt": "x", "temperature": Infinity}', "temperature", ["temperature", "finite"]),
    ('{"prompt": "x", "n": 100000}', "n", ["n=100000", "max_num_seqs"]),
    ('{"prompt": "x", "n": 4, "max_tokens": 2000, "ignore_eos": true}', "max_tokens", ["never fit", "blocks"]),
    ('{"prompt": [true, false]}', "prompt", ["prompt", "str", "list[int]"]),
    ('[1, 2]', None, ["must be a JSON object", "list"]),
    ('"hello"', None, ["must be a JSON object", "str"]),
    ('{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options", ["stream"]),
])
def test_error_objects_name_the_param_and_no_engine_ids(served, content, param, words):
    llm, server = served
    r = raw_post(server, "/v1/completions", content)
    assert_openai_error(r, 400, *words)
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert error["code"] in (None, "context_length_exceeded"), error   # a word or null, never "400"
    assert "None" not in error["message"] and not re.search(r"sequence \d", error["message"]), error
    assert wait_idle(llm)[0] == CONFIG["num_kvcache_blocks"]


def test_other_statuses_have_word_types_and_codes(served):
    llm, server = served
    wrong_method = raw_post(server, "/v1/completions", "", method="GET")
    assert_openai_error(wrong_method, 405)
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert wrong_method.json()["error"]["code"] is None
    unknown = raw_post(server, "/v1/completions", '{"prompt": "x", "model": "gpt-4"}')
    assert unknown.status_code == 404     # OpenAI's answer for a model that does not exist:
    assert (unknown.json()["error"]["type"], unknown.json()["error"]["code"]) == ("invalid_request_error",
                                                                                  "model_not_found")


def test_include_usage_puts_a_null_usage_in_every_chunk_but_the_last(served):
    llm, server = served
    for stream_options, has_usage in (({"include_usage": True}, True), ({"include_usage": False}, False)):
        body = {"prompt": "Blocks", "max_tokens": 4, "temperature": 0, "stream": True, "n": 2,
                "stream_options": stream_options}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        if has_usage:
            assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
        else:
            assert all("usage" not in c for c in chunks) and all(c["choices"] for c in chunks)


def test_a_completion_ended_by_a_stop_string_stops_generating_while_its_sibling_goes_on(offline, one_torch_thread):
    params = SamplingParams(temperature=1.0, seed=21, n=2, max_tokens=40, ignore_eos=True)
    want = reference(offline, [PROMPTS[3]], params)[0]
    first, second = want.outputs[0].text, want.outputs[1].text
    # A stop string early in completion 0 that completion 1 never contains.
    stop = next(first[i:i + 3] for i in range(4, len(first) - 3)
                if first[i:i + 3].strip() and first[i:i + 3] not in second)
    cut = first[:first.index(stop)]
    assert len(offline.tokenizer.encode(cut, add_special_tokens=False)) < 30, "the stop fires early"
    llm = AsyncLLM(**CONFIG)

    async def main():
        state = await llm.add_request(PROMPTS[3], params, stop=[stop], output_kind=RequestOutputKind.FINAL_ONLY)
        seq = await asyncio.to_thread(llm.call_in_engine_thread, lambda engine, live: engine.get_sequence(state.engine_id))
        outs = [o async for o in llm.outputs(state)]
        return seq, outs[-1]
    try:
        seq, out = run_in_fresh_loop(main())
        assert [(c.text, c.finish_reason) for c in out.outputs] == [(cut, "stop"), (second, "length")]
        stopped = seq if seq.index == 0 else seq.children[0]
        assert stopped.finish_reason == "abort"   # the engine stopped it ...
        assert stopped.num_completion_tokens < 34, stopped.num_completion_tokens   # ... soon after the stop
        assert wait_idle(llm)[0] == CONFIG["num_kvcache_blocks"]
    finally:
        llm.shutdown()


def test_streamed_logprobs_are_each_tokens_own_also_for_a_speculative_step(one_torch_thread):
    """The engine hands out what each step appended with a log-probability per token
    (``step_core``): a speculative step that yields several tokens streams a finite
    log-probability for each, and they add up to the offline completion's cumulative one."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    kwargs = dict(device="cpu", attention_backend="torch", block_size=4, num_kvcache_blocks=64, speculative_config=spec)
    prompt = "the cache the cache the cache the cache the cache"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [want] = LLM(default_model_path(), **kwargs).generate([prompt], params, use_tqdm=False)
    llm = AsyncLLM(default_model_path(), **kwargs)
    try:
        async def main():
            return [o async for o in llm.generate(prompt, params, output_kind=RequestOutputKind.DELTA)]
        outs = run_in_fresh_loop(main())
        spec_steps = llm.engine.get_metrics().spec_decode_num_accepted_tokens
    finally:
        llm.shutdown()
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    logprobs = [lp for o in outs for lp in o.outputs[0].logprobs]
    assert tokens == want.token_ids and len(logprobs) == len(tokens)
    assert spec_steps > 0, "no step accepted a draft: the prompt must repeat"
    assert any(len(o.outputs[0].token_ids) > 1 for o in outs), "no step streamed several tokens"
    assert all(lp == lp and lp <= 0 for lp in logprobs)   # no NaN
    assert abs(sum(logprobs) - want.outputs[0].cumulative_logprob) < 1e-4


def test_a_call_in_the_engine_thread_that_raises_keyboard_interrupt_leaves_the_loop_serving(served):
    llm, _ = served

    def interrupted(engine, live):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.call_in_engine_thread(interrupted)
    assert llm.is_running
    assert llm.call_in_engine_thread(lambda engine, live: engine.num_steps) >= 0   # the loop still answers


def test_tokenizing_a_prompt_leaves_the_event_loop_serving(served, client):
    """While a prompt is being tokenized (held here until /health has answered), the server
    answers other requests: tokenization runs off the event loop."""
    import threading

    llm, server = served
    tokenizer = llm.tokenizer
    started, release = threading.Event(), threading.Event()
    real_encode = tokenizer.encode

    def slow_encode(*args, **kwargs):
        started.set()
        release.wait(30)
        return real_encode(*args, **kwargs)

    tokenizer.encode = slow_encode
    try:
        pending = threading.Thread(target=lambda: client.completions.create(model=llm.model_name, prompt="Once upon",
                                                                            max_tokens=2, temperature=0))
        pending.start()
        assert started.wait(30)
        health = httpx.get(server.url + "/health", timeout=5)   # would time out on a blocked event loop
        assert health.status_code == 200
    finally:
        release.set()
        del tokenizer.encode
    pending.join(30)
    assert not pending.is_alive()


def test_a_request_id_is_free_again_as_soon_as_its_stream_is_closed(served):
    """``aclose()`` on ``generate`` aborts at once, so the id may be used again right away,
    while the engine core has yet to run the abort (the core knows requests by a key of its own)."""
    llm, _ = served

    async def main():
        gen = llm.generate("Blocks", SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
                           request_id="A", output_kind=RequestOutputKind.DELTA)
        await anext(gen)
        await gen.aclose()
        return [out async for out in llm.generate("Blocks", SamplingParams(temperature=0.0, max_tokens=4),
                                                  request_id="A")][-1]
    last = run_in_fresh_loop(main())
    assert last.finished and len(last.outputs[0].token_ids) == 4
    assert wait_idle(llm)[0] == CONFIG["num_kvcache_blocks"]
