"""An OpenAI-compatible HTTP server over ``AsyncLLM`` (chapter 13), as vLLM's ``api_server``.

``build_app(llm)`` returns a FastAPI app with:

* ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` -- OpenAI's
  shapes, ``stream: true`` as server-sent events (``data: {chunk}`` lines, then
  ``data: [DONE]``), ``usage`` with ``prompt_tokens_details.cached_tokens`` (the prompt tokens
  the prefix cache provided), and vLLM's ``cache_salt`` (chapter 12);
* ``GET /health`` (200 while the engine loop runs), ``GET /metrics`` (the engine's Prometheus
  registry, vLLM's names);
* ``GET /dashboard`` and its feed ``GET /dashboard/events`` (:mod:`course_pkg.serve.dashboard`).

Errors come back in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with
the status a client can act on: 400 for a malformed body, an unknown field, a bad value or a
prompt that does not fit the context; 404 for an unknown model; 503 when the waiting queue is
full (``max_waiting``) or the engine is shutting down. A fault the engine could not get past
is a 500 that says what failed -- never a traceback. ``param`` names the field at fault (or is
null); ``code`` is a word for the cases a client can act on (``context_length_exceeded``,
``model_not_found``, ``queue_full``...) or null, as OpenAI's; messages never name the engine's
internal sequence ids. A client that disconnects (mid-stream or
while waiting for a whole completion) aborts its request: its blocks are freed at once.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from course_pkg.engine.async_llm import (AsyncLLM, EngineDeadError, EngineGenerateError, QueueFullError,
                                         RequestOutputKind, RequestState)
from course_pkg.sampling_params import SamplingParams
from course_pkg.serve.protocol import ChatCompletionRequest, CompletionRequest
from course_pkg.validation import check_token_ids


class APIError(Exception):
    """An error the client gets in OpenAI's shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


_ERROR_TYPES = {503: "service_unavailable_error"}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object. ``type`` is a word: every 4xx is an ``invalid_request_error`` (OpenAI's
    type for a model that does not exist too, a 404 whose ``code`` is ``model_not_found``), a 503
    a ``service_unavailable_error``, any other 5xx an ``internal_server_error``; ``code`` is a
    word naming the case, or null."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.status, e.param, e.code), status_code=e.status)


def as_api_error(e: BaseException) -> APIError:
    """What a client is told about an exception raised while serving its request."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, TypeError)):       # the engine refused the request: nothing was queued
        return _engine_refusal(str(e))
    if isinstance(e, QueueFullError):
        return APIError(str(e), 503, code="queue_full")
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503, code="engine_dead")
    if isinstance(e, EngineGenerateError):
        return APIError(str(e), 500, code="engine_step_failed")
    return APIError(f"internal error: {type(e).__name__}: {e}", 500)


# The engine's messages name its sequence ids, which mean nothing to a client: say "the request".
_ENGINE_IDS = [(re.compile(r"\bprompt of sequence \d+"), "the prompt"), (re.compile(r"\bsequence \d+"), "the request")]
_ENGINE_PARAMS = [("can never fit", "max_tokens"), ("asks for n=", "n"), ("prompt", "prompt")]


def _engine_refusal(message: str) -> APIError:
    """A ValueError/TypeError of ``LLMEngine.add_request`` as a 400 without engine ids."""
    for pattern, words in _ENGINE_IDS:
        message = pattern.sub(words, message)
    param = next((p for key, p in _ENGINE_PARAMS if key in message), None)
    return APIError(message, param=param)


# pydantic names the member of a union that failed ("prompt.str", "prompt.list[int].0"): not a field.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


def _validation_message(errors) -> tuple[str, str | None]:
    """pydantic's errors -> one sentence naming the field (the first error), and that field."""
    first = errors[0]
    raw_loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    loc = [x for x in raw_loc if not _UNION_MEMBER.match(x)]
    field = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})", None
    if not raw_loc and kind != "missing":   # the body parsed, but as a list, a string, a number
        return (f"the request body must be a JSON object, got {type(first.get('input')).__name__} "
                f"{first.get('input')!r:.60}"), None
    if len(loc) < len(raw_loc):   # a union (prompt: str | list[int]) none of whose members fit
        members = dict.fromkeys(str(x) for e in errors for x in e.get("loc", ()) if _UNION_MEMBER.match(str(x)))
        return f"field {field!r} must be one of: {', '.join(members)} (got {first.get('input')!r:.80})", field
    if kind == "extra_forbidden":
        return f"unknown field {field!r}: this server does not accept it", field
    if kind == "missing" and not loc:
        return "the request needs a JSON body", None
    if kind == "missing":
        return f"field {field!r} is required", field
    return f"field {field!r}: {first.get('msg', 'invalid value')} (got {first.get('input')!r})", field


def build_app(llm: AsyncLLM, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` (which the caller owns and shuts down)."""
    from course_pkg.serve.dashboard import add_dashboard

    app = FastAPI(title="course_pkg OpenAI-compatible server", docs_url=None, redoc_url=None)
    model_name = served_model_name or llm.model_name
    app.state.llm, app.state.model_name = llm, model_name
    created = int(time.time())
    tokenizer = llm.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    @app.exception_handler(APIError)
    async def _on_api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _on_any_error(request, exc: Exception):
        return error_response(as_api_error(exc))

    # ---------------------------------------------------------------- small endpoints

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return error_response(as_api_error(llm._dead()))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        text = await asyncio.to_thread(llm.metrics_text)   # (from an engine core process: one call there)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "course_pkg", "root": str(llm.model_path),
                                            "max_model_len": llm.max_model_len}]}

    # ---------------------------------------------------------------- the two generation endpoints

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(f"the model {name!r} does not exist: this server serves {model_name!r}", 404,
                           param="model", code="model_not_found")

    def prompt_token_ids(prompt) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
            ids = tokenizer.encode(prompt, add_special_tokens=False)   # as LLMEngine encodes text
            if not ids:
                raise APIError("the prompt is empty: it encodes to no tokens", param="prompt")
            return ids
        if not prompt:
            raise APIError("the prompt is empty: a request needs at least one token", param="prompt")
        try:
            return check_token_ids("prompt", prompt, llm.vocab_size)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None

    def sampling_params(req, num_prompt_tokens: int, max_tokens: int | None) -> SamplingParams:
        """The request's SamplingParams, its length checked against the context (vLLM's message)."""
        limit = llm.max_model_len
        if num_prompt_tokens >= limit:
            raise APIError(f"this model's maximum context length is {limit} tokens; the prompt has "
                           f"{num_prompt_tokens}, which leaves no room for a completion", param="prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - num_prompt_tokens
        elif num_prompt_tokens + max_tokens > limit:
            raise APIError(f"this model's maximum context length is {limit} tokens; you requested "
                           f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, {max_tokens} "
                           f"in the completion): reduce the prompt or max_tokens", param="max_tokens",
                           code="context_length_exceeded")
        n, max_num_seqs = req.n or 1, llm.max_num_seqs
        if n > max_num_seqs:
            raise APIError(f"n={n} completions cannot run at once: this server runs at most {max_num_seqs} "
                           f"sequences (max_num_seqs); use n <= {max_num_seqs}", param="n")
        kwargs = dict(max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos), n=n, seed=req.seed)
        if req.temperature is not None:
            kwargs["temperature"] = req.temperature
        if req.top_p is not None:
            kwargs["top_p"] = req.top_p
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:   # its messages begin with the field's name
            raise APIError(str(e), param=next((k for k in kwargs if str(e).startswith(k)), None)) from None

    async def start(req, ids: list[int], text: str | None, max_tokens: int | None, prefix: str) -> RequestState:
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options is allowed only with stream: true", param="stream_options")
        params = sampling_params(req, len(ids), max_tokens)
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        if stop is not None and (len(stop) > 4 or any(s == "" for s in stop)):
            raise APIError("stop takes at most 4 strings, none of them empty", param="stop")
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        # A salted prompt is vLLM's TokensPrompt with a cache_salt (chapter 12); the engine checks the salt.
        prompt = ids if req.cache_salt is None else {"prompt_token_ids": ids, "cache_salt": req.cache_salt}
        try:
            state = await llm.add_request(prompt, params, f"{prefix}-{uuid.uuid4().hex[:16]}", stop=stop,
                                          output_kind=kind)
        except Exception as e:
            raise as_api_error(e) from None
        state.prompt = text
        return state

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        check_model(req.model)
        if req.logprobs:
            raise APIError("this engine computes only the sampled token's log-probability: logprobs must be 0 "
                           "(each token's own log-probability) or absent", param="logprobs")
        ids = await asyncio.to_thread(prompt_token_ids, req.prompt)   # (a long text: the event loop serves on)
        state = await start(req, ids, req.prompt if isinstance(req.prompt, str) else None, req.max_tokens, "cmpl")
        shape = _CompletionShape(state, model_name, with_logprobs=req.logprobs is not None, tokenizer=tokenizer,
                                 token_ids=bool(req.return_tokens_as_token_ids))
        return await _respond(llm, state, shape, raw, req)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        if req.top_logprobs:
            raise APIError("this engine computes only the sampled token's log-probability: top_logprobs must "
                           "be 0 or absent", param="top_logprobs")
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(f"the model {model_name!r} has no chat template, so messages cannot be turned into a "
                           f"prompt: use /v1/completions, or give the model folder a chat_template.jinja",
                           param="messages", code="no_chat_template")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]

        def chat_prompt():
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return text, prompt_token_ids(text)

        text, ids = await asyncio.to_thread(chat_prompt)   # (a long conversation: the event loop serves on)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise APIError("give max_tokens or max_completion_tokens, not both", param="max_tokens")
        state = await start(req, ids, text, req.max_completion_tokens or req.max_tokens, "chatcmpl")
        shape = _ChatShape(state, model_name, with_logprobs=bool(req.logprobs), tokenizer=tokenizer,
                           token_ids=bool(req.return_tokens_as_token_ids))
        return await _respond(llm, state, shape, raw, req)

    add_dashboard(app, llm)
    return app


# -------------------------------------------------------------------- responses

async def _respond(llm: AsyncLLM, state: RequestState, shape, raw: Request, req):
    """A whole JSON response, or a stream of server-sent events; either way a client that goes
    away aborts the request."""
    if req.stream:
        shape.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _EngineStream(llm, state, _sse(llm, state, shape))
    task = asyncio.ensure_future(_last_output(llm, state))
    gone = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():          # the client left (or this handler was cancelled): abort
            task.cancel()
            llm.abort_state(state)
    if not task.done() or task.cancelled():
        return Response(status_code=499)   # nobody reads it; nginx's "client closed request"
    try:
        out = task.result()
    except Exception as e:
        return error_response(as_api_error(e))
    return JSONResponse(shape.whole(out))


async def _last_output(llm: AsyncLLM, state: RequestState):
    last = None
    async for out in llm.outputs(state):
        last = out
    return last


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (vLLM's ``listen_for_disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _EngineStream(StreamingResponse):
    """A streamed response that aborts its request however it ends (finished, client gone,
    cancelled before the first chunk)."""

    def __init__(self, llm: AsyncLLM, state: RequestState, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._llm, self._state = llm, state

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._llm.abort_state(self._state)


def _event(payload) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse(llm: AsyncLLM, state: RequestState, shape):
    last = None
    try:
        first = True
        async for out in llm.outputs(state):
            last = out
            for chunk in shape.chunks(out, first):
                yield _event(chunk)
            first = False
        if shape.include_usage and last is not None:
            yield _event(shape.usage_chunk(last))
    except Exception as e:   # the stream has begun: the error goes in it, as OpenAI sends one
        err = as_api_error(e)
        yield _event(error_body(err.message, err.status, err.param, err.code))
    yield "data: [DONE]\n\n"


def usage(out) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


class _CompletionShape:
    """``/v1/completions``'s JSON: ``text_completion`` objects, whole or as chunks."""

    object = "text_completion"

    def __init__(self, state: RequestState, model: str, with_logprobs: bool, tokenizer, token_ids: bool = False):
        self.id, self.model, self.created = state.request_id, model, int(time.time())
        self.with_logprobs, self.tokenizer, self.as_token_ids = with_logprobs, tokenizer, token_ids
        self.offsets: dict[int, int] = {}   # completion index -> text offset of its next token (streams)
        self.n = state.sampling_params.n
        self.completion_tokens = 0          # tokens streamed so far (a stream's chunks hold only deltas)
        self.include_usage = False          # stream_options.include_usage: every chunk has "usage"

    def _token_text(self, token_id: int) -> str:
        if self.as_token_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def logprobs(self, c) -> dict | None:
        if not self.with_logprobs:
            return None
        tokens = [self._token_text(t) for t in c.token_ids]
        offsets, at = [], self.offsets.get(c.index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self.offsets[c.index] = at
        return {"tokens": tokens, "token_logprobs": list(c.logprobs), "text_offset": offsets,
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, c.logprobs)]}

    def choice(self, c) -> dict:
        return {"index": c.index, "text": c.text or "", "logprobs": self.logprobs(c),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def head(self) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def whole(self, out) -> dict:
        return {**self.head(), "choices": [self.choice(c) for c in out.outputs], "usage": usage(out)}

    def chunk(self, head: dict, choices: list) -> dict:
        """A stream's chunk; with include_usage its ``usage`` is null until the last (OpenAI's rule)."""
        return {**head, "choices": choices, **({"usage": None} if self.include_usage else {})}

    def chunks(self, out, first: bool):
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        yield self.chunk(self.head(), [self.choice(c) for c in out.outputs])

    def stream_usage(self, out) -> dict:
        prompt = len(out.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def usage_chunk(self, out) -> dict:
        return {**self.head(), "choices": [], "usage": self.stream_usage(out)}


class _ChatShape(_CompletionShape):
    """``/v1/chat/completions``'s JSON: ``chat.completion`` and ``chat.completion.chunk``."""

    object = "chat.completion"

    def logprobs(self, c) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"content": [{"token": (t := self._token_text(i)), "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": []} for i, lp in zip(c.token_ids, c.logprobs)]}

    def whole(self, out) -> dict:
        return {**self.head(), "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text or ""},
             "logprobs": self.logprobs(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in out.outputs], "usage": usage(out)}

    def head(self) -> dict:
        return {**super().head(), "object": "chat.completion"}

    def chunks(self, out, first: bool):
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        head = {**super().head(), "object": "chat.completion.chunk"}
        if first:   # OpenAI opens every choice with the role
            yield self.chunk(head, [{"index": j, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None} for j in range(self.n)])
        yield self.chunk(head, [{"index": c.index, "delta": {"content": c.text or ""},
                                 "logprobs": self.logprobs(c), "finish_reason": c.finish_reason}
                                for c in out.outputs])

    def usage_chunk(self, out) -> dict:
        return {**super().head(), "object": "chat.completion.chunk", "choices": [],
                "usage": self.stream_usage(out)}
