"""``AsyncLLM``: the engine behind a server -- one loop steps it, callers stream (chapter 13).

``LLM.generate`` takes a list and returns when every request is done. A server receives
requests one at a time, at any moment, and wants each one's tokens as soon as they exist.
vLLM v1 puts an *engine core* loop between the two, and ``AsyncLLM`` (vLLM's name) is this
course's version of it::

    callers (asyncio)               commands            engine core (owns the LLMEngine)
    generate(prompt) ── add ──────────> [add, abort] ──>   while work exists:
      async for out in ...:                                    add_request / abort_request
        <── RequestOutput ── output processor <── tokens ──     step()   (a transaction)
                (detokenize, stop strings,                     new tokens of every request
                 DELTA / CUMULATIVE / FINAL_ONLY)

* **One loop owns the engine.** ``LLMEngine`` serves one thread at a time; here every
  ``add_request``, ``abort_request`` and ``step`` runs in :class:`EngineCore`'s loop, which
  takes commands between steps and sleeps on them when nothing is left to do. The core's
  semantics are untouched: the loop is a caller of ``add_request``/``step``/``abort_request``.
  The loop knows requests by their ids only, so it runs either on a thread of this process
  (the default) or, with ``engine_core_process=True``, in a process of its own, as vLLM runs
  it (``EngineCoreProc``, linked by ZMQ there, by a pipe here): then the engine's steps and the
  server's event loop stop taking turns at one GIL.
* **Tokens out after every step.** ``LLMEngine.step_core`` returns what the step brought each
  request (vLLM's ``EngineCoreOutput``: new token ids and their log-probabilities per
  completion, finish reasons), and the core sends that, one batch per step, to the caller's
  side; the *output processor* there turns them into text, finds stop strings and shapes the
  output as vLLM's ``RequestOutputKind`` asks: ``DELTA`` (what is new), ``CUMULATIVE``
  (everything so far) or ``FINAL_ONLY``.
* **Cancelling aborts.** Closing the generator (``await gen.aclose()``, what a server does when
  its client disconnects), cancelling the task that iterates it, or the generator being
  garbage-collected after a ``break`` aborts the request: its blocks are freed before the next
  step. (A bare ``break`` only leaves the generator suspended; the abort then waits for the
  garbage collector, so close it.) With ``n > 1``, a completion that ends on a stop string is
  aborted in the engine on its own: it stops generating while its siblings go on.
* **A fault fails a step, not the loop.** A step is a transaction (ARCHITECTURE.md, "The undo
  log"): if it raises, the engine is as it was before it. The loop tries the step again
  (``max_step_retries`` times: a transient fault costs nothing); if it keeps failing, the
  requests that step schedules (found by scheduling it once more and undoing it) are aborted
  and their callers get :class:`EngineGenerateError`; every other request carries on.
* **Clean shutdown.** ``shutdown()`` stops the loop; every request still in flight is aborted
  and its caller gets :class:`EngineDeadError` saying so, as does every ``add_request`` that
  races it. The engine is closed only once the loop has stopped, never under a running step.
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import pickle
import queue
import sys
import threading
import uuid
from pathlib import Path
from collections.abc import AsyncIterator, Sequence as SequenceABC
from dataclasses import dataclass, field, replace

from course_pkg.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from course_pkg.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestOutputKind(enum.Enum):
    """What each output of ``AsyncLLM.generate`` holds (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0   # every token and the whole text so far
    DELTA = 1        # only what is new since the last output
    FINAL_ONLY = 2   # one output, when the request has finished


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (``shutdown``); requests in flight were aborted (vLLM's name)."""


class EngineGenerateError(RuntimeError):
    """A step kept failing with this request in it; the request was aborted (vLLM's name)."""


class QueueFullError(RuntimeError):
    """``max_waiting`` requests already wait beyond the free seats: admission control refuses another."""


@dataclass
class _Delta:
    """What the engine core sends after a step, per request (vLLM's ``EngineCoreOutput``)."""

    new_token_ids: dict[int, list[int]]          # completion index -> tokens sampled since last time
    new_logprobs: dict[int, list[float]]
    finish_reasons: dict[int, str]               # completion index -> reason, once it has finished
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics | None
    finished: bool                               # the engine has handed the request out


@dataclass
class _Completion:
    """The output processor's state of one completion."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""              # the text as it will be handed out (cut at a stop string)
    sent_text: int = 0          # characters of ``text`` already handed out (DELTA)
    sent_tokens: int = 0        # tokens already handed out (DELTA)
    finish_reason: str | None = None
    stop_reason: str | None = None   # the stop string that ended it (vLLM's ``stop_reason``)
    delta_done: bool = False    # its last DELTA output (with the finish reason) went out


class RequestState:
    """One request as the caller's side sees it: the engine's ids, the caller's queue and the
    output processor's per-completion state (vLLM's ``RequestState`` in its output processor)."""

    def __init__(self, request_id: str, prompt, sampling_params: SamplingParams, stop: tuple[str, ...],
                 output_kind: RequestOutputKind, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        self.engine_prompt = prompt   # what LLMEngine.add_request takes (text, ids, or a dict with a cache_salt)
        self.sampling_params = sampling_params
        self.stop = stop
        self.output_kind = output_kind
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.added = loop.create_future()        # the engine id, or the exception add_request raised
        self.key: int | None = None              # the engine core's name for it (unique, unlike request ids)
        # From the engine core once it has added the request:
        self.engine_id: int | None = None
        self.seq_prompt_ids: list[int] = []
        # Output processor only:
        self.completions = [_Completion(i) for i in range(sampling_params.n)]
        self.prompt_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.metrics: RequestMetrics | None = None
        self.finished = False        # every completion has its finish reason
        self.engine_done = False     # the engine has handed the request out (or aborted it)


class AsyncLLM:
    """An ``LLMEngine`` stepped by an engine core loop, streamed from asyncio.

    ``AsyncLLM(model=None, max_waiting=None, max_step_retries=1, engine_core_process=False,
    **engine_kwargs)`` builds the engine (the keyword arguments are :class:`EngineConfig`'s) and
    starts the loop; ``AsyncLLM.from_engine(engine)`` wraps one already built (the loop then owns
    it: nothing else may call it). ``max_waiting`` (at least 1) bounds the waiting queue: a
    request is refused with :class:`QueueFullError` (a server's 503) when that many requests
    already wait *beyond the free running seats* (``max_num_seqs`` less the sequences running)
    -- a request the next step can admit does not count as waiting.

    ``engine_core_process=True`` runs the engine core in a process of its own (vLLM's
    ``EngineCoreProc``) instead of a thread of this one: the engine's steps and this process's
    event loop then never wait for each other's GIL. The engine is built there, so ``engine=``
    is refused, ``self.engine`` is None, step listeners (the dashboard) are not available, and
    ``call_in_engine_thread`` takes only functions that can be pickled (defined at module level).
    The process is *spawned* (a fresh interpreter), so a script that starts one must do it under
    ``if __name__ == "__main__":``, as with any spawned process.

    Use ``async for out in llm.generate(prompt, params): ...``; call ``shutdown()`` at the end.
    """

    def __init__(self, model=None, *, max_waiting: int | None = None, max_step_retries: int = 1,
                 engine=None, engine_core_process: bool = False, **engine_kwargs):
        from course_pkg.models import default_model_path, load_tokenizer
        from course_pkg.validation import check_int

        if max_waiting is not None:
            check_int("max_waiting", max_waiting, minimum=1)
        check_int("max_step_retries", max_step_retries, minimum=0)
        if not isinstance(engine_core_process, bool):
            raise TypeError(f"engine_core_process must be a bool, got {engine_core_process!r}")
        if engine_core_process and engine is not None:
            raise ValueError("engine_core_process=True builds the engine in its own process: pass the "
                             "engine's arguments, not engine=")
        self.max_waiting = max_waiting
        self.max_step_retries = max_step_retries
        self.engine_core_process = engine_core_process
        self._routes: dict[int, RequestState] = {}       # key -> state, until the core is done with it
        self._keys = itertools.count()
        self._by_request_id: dict[str, RequestState] = {}   # the requests a caller may still abort
        self._calls: dict[int, queue.SimpleQueue] = {}   # call id -> where its answer goes
        self._call_ids = itertools.count()
        self.errored: BaseException | None = None        # why the loop died, if it did
        self._stopping = False
        self._closed = False
        if engine_core_process:
            self.engine = None
            self._client = _ProcessClient(self, model, engine_kwargs)
            info = self._client.info
        else:
            from course_pkg.engine.llm_engine import LLMEngine
            self.engine = engine if engine is not None else LLMEngine(model, **engine_kwargs)
            self._client = _ThreadClient(self)
            info = _engine_info(self.engine)
        cfg_model = info["model"]
        self.model_path = default_model_path() if cfg_model is None else cfg_model
        self.model_name = "course-tiny" if cfg_model is None else Path(cfg_model).name   # as the metrics label it
        self.max_model_len, self.vocab_size, self.max_num_seqs = info["max_model_len"], info["vocab_size"], \
            info["max_num_seqs"]
        # The output processor's own tokenizer: the engine may be decoding with its own at the same
        # moment (vLLM's API server also holds a tokenizer of its own).
        self.tokenizer = load_tokenizer(self.model_path)
        self._commands = self._client.commands   # what the caller's side sends the core: put((command, arg))
        self._client.start()

    @classmethod
    def from_engine(cls, engine, **kwargs) -> "AsyncLLM":
        return cls(engine=engine, **kwargs)

    # ------------------------------------------------------------ the caller's side

    @property
    def is_running(self) -> bool:
        return self._client.is_alive() and not self._stopping

    async def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, *, stop: SequenceABC[str] | str | None = None,
                          output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> RequestState:
        """Queue a request on the engine core; returns once it is queued or refused.

        Raises what ``LLMEngine.add_request`` raises for a bad request (``ValueError``,
        ``TypeError``: nothing is queued), :class:`QueueFullError` when the waiting queue is
        full, :class:`EngineDeadError` once the loop has stopped.
        """
        sampling_params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if not isinstance(output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {output_kind!r}")
        stop = _check_stop(stop)
        request_id = f"req-{uuid.uuid4().hex}" if request_id is None else request_id
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._by_request_id:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if not self.is_running:
            raise self._dead()
        state = RequestState(request_id, prompt, sampling_params, stop, output_kind, asyncio.get_running_loop())
        state.key = next(self._keys)   # (an id may come back while the core still finishes its abort)
        self._by_request_id[request_id] = state
        self._routes[state.key] = state
        try:
            self._commands.put(("add", state))
        except BaseException:   # (an engine core process: a prompt that does not pickle)
            self._by_request_id.pop(request_id, None)
            self._routes.pop(state.key, None)
            raise
        if self._stopping or not self._client.is_alive():
            # The loop may have stopped between the check above and the put, after its last
            # look at its commands: nobody would answer this add. (If it did see it, the answer
            # it sends later finds the future done and is dropped.)
            _set_exception(state.added, self._dead())
        try:
            await state.added
        except BaseException:
            self._by_request_id.pop(request_id, None)
            refused = state.added.done() and not state.added.cancelled() and state.added.exception() is not None
            if refused:
                self._routes.pop(state.key, None)
            else:   # cancelled while queued: this abort runs after the add, and undoes it
                self._commands.put(("abort", state))
            raise
        return state

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, stop: SequenceABC[str] | str | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs as its tokens arrive (vLLM's ``AsyncLLM.generate``).

        ``stop``: strings that end a completion when its text contains one (the text is cut
        before it; ``finish_reason`` is ``"stop"``, ``stop_reason`` the string). Closing the
        generator (``aclose()``), cancelling the task iterating it, or the generator being
        garbage-collected aborts the request (a bare ``break`` leaves it to the garbage
        collector: close it). Raises what ``add_request``
        raises, :class:`EngineGenerateError` if a step kept failing with this request in it,
        :class:`EngineDeadError` if the engine shut down meanwhile.
        """
        state = await self.add_request(prompt, sampling_params, request_id, stop=stop, output_kind=output_kind)
        outputs = self.outputs(state)
        try:
            async for out in outputs:
                yield out
        finally:   # closing this generator closes that one now: the abort is sent at once
            await outputs.aclose()

    async def outputs(self, state: RequestState) -> AsyncIterator[RequestOutput]:
        """The outputs of a request queued by ``add_request`` (the second half of ``generate``)."""
        try:
            while not state.finished:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    state.finished = True
                    raise item
                out = self._process(state, item)
                if out is not None:
                    yield out
        finally:
            self.abort_state(state)

    async def abort(self, request_id: str) -> None:
        """Abort a request by its id: its blocks are freed before the next step, and its
        ``generate`` ends with ``finish_reason="abort"`` (a finished request is left alone)."""
        state = self._by_request_id.get(request_id)
        if state is not None:
            self.abort_state(state)

    def abort_state(self, state: RequestState) -> None:
        """``abort`` for a RequestState; safe from any thread, and a no-op once it is done."""
        self._by_request_id.pop(state.request_id, None)
        if not state.engine_done:   # cancelled, left early, or ended on stop strings
            self._commands.put(("abort", state))

    def call_in_engine_thread(self, fn, timeout: float = 30.0):
        """``fn(engine, live_sequences)`` run by the engine core between steps; returns its
        result (blocks the calling thread). ``live_sequences`` maps a name to each live
        completion's Sequence (what the dashboard draws). With ``engine_core_process=True`` it
        runs in the engine's process: ``fn`` and its result must pickle, and ``fn`` must be
        importable there (defined in a module, not in a notebook or a script's ``__main__``)."""
        if not self.is_running:
            raise self._dead()
        result: queue.SimpleQueue = queue.SimpleQueue()
        call_id = next(self._call_ids)
        self._calls[call_id] = result
        try:
            self._commands.put(("call", (call_id, fn)))
            ok, value = result.get(timeout=timeout)
        finally:
            self._calls.pop(call_id, None)
        if not ok:
            raise value
        return value

    def call_in_engine_thread_nowait(self, fn) -> None:
        """``fn(engine, live_sequences)`` queued for the engine core; its result is dropped."""
        self._commands.put(("call", (None, fn)))

    def add_step_listener(self, callback) -> None:
        """``callback(engine, live_sequences)`` runs in the engine core now and after every
        step, add and abort (the dashboard's feed). It must be quick and must not raise; one
        that raises is removed. Not with ``engine_core_process=True`` (RuntimeError)."""
        self._client.require_thread_core("step listeners (the dashboard)")
        self._commands.put(("listen", callback))

    def remove_step_listener(self, callback) -> None:
        self._commands.put(("unlisten", callback))

    def metrics_text(self) -> bytes:
        """The engine's Prometheus metrics in the text format (``GET /metrics``); from any thread."""
        if self.engine is not None:   # (the registry reads the engine's counters; no step needed)
            return _metrics_text(self.engine, {})
        return self.call_in_engine_thread(_metrics_text)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests in flight are aborted and their callers get EngineDeadError.

        Waits up to ``timeout`` seconds for the loop to finish its step. If it has not, raises
        ``TimeoutError`` and leaves the engine open (closing it under a running step would pull
        its workers from under the forward pass); call ``shutdown()`` again to finish.
        """
        self._stopping = True      # from now on add_request refuses
        if not self._client.stop(timeout):
            raise TimeoutError(f"the engine loop did not stop within {timeout} s (a step is still "
                               f"running); the engine was left open: call shutdown() again")
        self._fail_routes(self._dead())   # anything queued after the loop's own last look
        if not self._closed:
            self._closed = True
            if self.engine is not None:   # (an engine core process closes its engine itself)
                self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _dead(self) -> EngineDeadError:
        return _dead_error(self.errored)

    @property
    def num_step_faults(self) -> int:
        """Steps that raised (and were rolled back) so far."""
        self._client.require_thread_core("the fault count")
        return self._client.core.num_step_faults

    # ------------------------------------------------------------ what the core sends back

    def _deliver(self, messages: list[tuple]) -> None:
        """Messages from the engine core (its thread, or the thread reading its process's pipe):
        hand each to the event loop of the request it is for, one wake-up per loop per batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for kind, key, payload in messages:
            if kind == "result":   # a call_in_engine_thread's answer: (ok, value)
                answer = self._calls.get(key)
                if answer is not None:
                    answer.put(payload)
                continue
            if kind == "died":     # the core's loop itself failed (payload: the exception)
                self.errored = self.errored or payload
                continue
            state = self._routes.get(key)
            if state is None:
                continue
            if kind != "added" and (kind != "delta" or payload.finished):
                self._routes.pop(key, None)   # the core is done with it
            by_loop.setdefault(state.loop, []).append((state, kind, payload))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_apply_all, items)
            except RuntimeError:   # that event loop is closed: nobody is listening any more
                pass

    def _fail_routes(self, error: BaseException) -> None:
        """The core has stopped: every request it had not finished with, and every call waiting
        for an answer, gets ``error``."""
        self._deliver([("error", key, error) for key in list(self._routes)]
                      + [("result", call_id, (False, error)) for call_id in list(self._calls)])

    def _core_stopped(self, errored: BaseException | None) -> None:
        """The engine core's loop has ended (its thread returned, or its process closed the pipe)."""
        if errored is not None and self.errored is None:
            self.errored = errored
        self._stopping = True
        self._fail_routes(self._dead())

    # ------------------------------------------------------------ the output processor

    def _process(self, state: RequestState, d: _Delta) -> RequestOutput | None:
        """Tokens from the engine core -> text, stop strings, the output kind. Caller's thread."""
        state.prompt_token_ids = state.prompt_token_ids or list(state.seq_prompt_ids)
        state.num_cached_tokens = d.num_cached_tokens
        state.metrics = d.metrics or state.metrics
        state.engine_done = d.finished
        stopped = []   # completions that end on a stop string in this output
        for c in state.completions:
            if c.finish_reason is not None:
                continue   # finished here already (a stop string): later tokens are not its own
            c.token_ids += d.new_token_ids.get(c.index, [])
            c.logprobs += d.new_logprobs.get(c.index, [])
            engine_reason = d.finish_reasons.get(c.index)
            if self.tokenizer is not None:
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                if state.stop:
                    # Search only where a new stop string can be: the old text's stable part
                    # (without a trailing U+FFFD) less a stop string's length.
                    start = max(0, len(c.text.rstrip("\ufffd")) - max(map(len, state.stop)) + 1)
                    cut, which = _find_stop(text, state.stop, start)
                    if which is not None:
                        text, c.finish_reason, c.stop_reason = text[:cut], "stop", which
                        stopped.append(c.index)
                c.text = text
            if c.finish_reason is None and engine_reason is not None:
                c.finish_reason = engine_reason
        if d.finished and any(c.finish_reason is None for c in state.completions):
            for c in state.completions:        # aborted in the engine: nothing more will come
                c.finish_reason = c.finish_reason or "abort"
        # Done when every completion is; if they all ended on stop strings before the engine
        # finished them, generate() aborts the request in the engine as it returns.
        state.finished = all(c.finish_reason is not None for c in state.completions)
        if stopped and not state.finished and not state.engine_done:
            # n > 1: the siblings go on, but this completion is done -- stop generating it.
            self._commands.put(("stop_completions", (state, stopped)))
        return self._make_output(state, final=state.finished)

    def _make_output(self, state: RequestState, final: bool) -> RequestOutput | None:
        kind = state.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not final:
            return None
        outputs = []
        hold = max(map(len, state.stop), default=1) - 1
        for c in state.completions:
            ready = len(c.text)
            if c.finish_reason is None:
                # Hold back what may still change: a trailing U+FFFD (a character whose bytes
                # span two tokens) and, with stop strings, the characters a stop string
                # beginning here could cover (its text is cut off, so it must not be sent).
                ready = max(c.sent_text, len(c.text.rstrip("\ufffd")) - hold)
            if kind is RequestOutputKind.DELTA:
                if c.delta_done:
                    continue
                text, tokens, lps = c.text[c.sent_text:ready], c.token_ids[c.sent_tokens:], c.logprobs[c.sent_tokens:]
                if not (text or tokens) and c.finish_reason is None:
                    continue
                c.sent_text, c.sent_tokens = ready, len(c.token_ids)
                c.delta_done = c.finish_reason is not None
            else:
                text, tokens, lps = c.text[:ready], list(c.token_ids), list(c.logprobs)
            outputs.append(CompletionOutput(index=c.index, text=text if self.tokenizer is not None else None,
                                            token_ids=tokens, cumulative_logprob=sum(c.logprobs),
                                            finish_reason=c.finish_reason, logprobs=lps, stop_reason=c.stop_reason))
        if not outputs:
            return None
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=list(state.prompt_token_ids), outputs=outputs,
                             num_cached_tokens=state.num_cached_tokens,
                             metrics=state.metrics if state.metrics is not None else RequestMetrics(0.0),
                             finished=final)


def _apply_all(items: list[tuple]) -> None:
    """The caller's event loop: what ``_deliver`` sent its requests."""
    for state, kind, payload in items:
        if kind == "added":          # payload: (engine id, the prompt's token ids)
            state.engine_id, state.seq_prompt_ids = payload
            _set_result(state.added, state.engine_id)
        elif kind == "refused":      # payload: the exception add_request raised
            _set_exception(state.added, payload)
        elif not state.added.done():   # an error before the add was answered: the add fails
            _set_exception(state.added, payload)
        else:                        # a _Delta, or the exception that ends the request
            state.queue.put_nowait(payload)


# ---------------------------------------------------------------- the engine core

class _EngineRequest:
    """A request as the engine core sees it."""

    __slots__ = ("key", "request_id", "engine_id", "seq", "num_prompt_tokens")

    def __init__(self, key: int, request_id: str, engine_id: int, seq):
        self.key, self.request_id, self.engine_id, self.seq = key, request_id, engine_id, seq
        self.num_prompt_tokens = len(seq.prompt_token_ids)


class EngineCore:
    """The engine side of ``AsyncLLM`` (vLLM's ``EngineCore`` busy loop): it owns the
    ``LLMEngine``, runs the commands that arrived, steps while work exists, and sends what each
    step brought every request. It knows a request by its *key* (a number the caller's side
    gives it) only, so the same loop runs on a thread of the server's process or in a process
    of its own.

    ``commands.get(block)`` returns one ``(command, arg)`` (raises ``queue.Empty`` when not
    blocking and none is there):

    ==================  ==========================================================
    ``add``             ``(key, request id, prompt, SamplingParams)``
    ``abort``           ``key``
    ``stop_completions`` ``(key, completion indices)``
    ``call``            ``(call id or None, fn)``; ``fn(engine, live_sequences)``, or
                        its pickle from another process
    ``listen``          ``callback`` (a thread core only), ``unlisten`` likewise
    ``stop``            ``None``
    ==================  ==========================================================

    ``emit(messages)`` sends a list of ``(kind, key, payload)``: ``("added", key, (engine id,
    prompt token ids))``, ``("refused", key, exception)``, ``("delta", key, _Delta)``,
    ``("error", key, exception)``, ``("result", call id, (ok, value))``.
    """

    def __init__(self, engine, commands, emit, *, max_waiting: int | None, max_step_retries: int):
        self.engine = engine
        self.commands, self.emit = commands, emit
        self.max_waiting, self.max_step_retries = max_waiting, max_step_retries
        self._requests: dict[int, _EngineRequest] = {}          # engine id -> request
        self._by_key: dict[int, _EngineRequest] = {}
        self._dashboards: list = []                              # callbacks fed after each step
        self._faults = 0
        self.num_step_faults = 0
        self.errored: BaseException | None = None

    def run(self) -> None:
        """The loop, until told to stop; then every request left gets an EngineDeadError."""
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain(block):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:   # a bug in the loop itself: say why, fail everyone
            logger.exception("the engine loop died")
            self.errored = e
        finally:
            self._fail_all(_dead_error(self.errored))

    def _drain(self, block: bool) -> bool:
        """Run the queued commands; wait for one if ``block``. False once told to stop."""
        while True:
            try:
                command, arg = self.commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command == "stop":
                return False
            getattr(self, f"_do_{command}")(arg)

    def _do_add(self, arg) -> None:
        key, request_id, prompt, sampling_params = arg
        engine = self.engine
        try:
            if self.max_waiting is not None and num_waiting_beyond_seats(engine) >= self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests wait beyond "
                                     f"the free seats): try again later")
            rid = engine.add_request(prompt, sampling_params)
        except Exception as e:
            self.emit([("refused", key, e)])
            return
        request = _EngineRequest(key, request_id, rid, engine.get_sequence(rid))
        self._requests[rid] = self._by_key[key] = request
        self.emit([("added", key, (rid, list(request.seq.prompt_token_ids)))])
        self._publish()

    def _forget(self, request: _EngineRequest) -> None:
        self._requests.pop(request.engine_id, None)
        self._by_key.pop(request.key, None)

    def _do_abort(self, key: int) -> None:
        request = self._by_key.get(key)
        if request is None:
            return   # never added, or already handed out
        self._forget(request)
        try:
            out = self.engine.abort_request(request.engine_id)
        except KeyError:
            out = None
        # The caller's generate() (if it still listens) ends with finish_reason "abort". Every token
        # went out with the step that made it: only the finish reasons are new.
        if out is None:
            delta = _Delta({}, {}, {}, request.num_prompt_tokens, 0, None, True)
        else:
            delta = _Delta({}, {}, {c.index: c.finish_reason for c in out.outputs}, request.num_prompt_tokens,
                           out.num_cached_tokens, _copy_metrics(out.metrics), True)
        self.emit([("delta", key, delta)])
        self._publish()

    def _do_stop_completions(self, arg) -> None:
        """Abort some completions of a request (they ended on stop strings); the rest go on."""
        key, indices = arg
        request = self._by_key.get(key)
        if request is None:
            return   # never added, or already handed out
        sched = self.engine.scheduler
        seqs = [request.seq] + list(request.seq.children)
        for seq in seqs:
            if seq.index in indices and sched.holds(seq):
                sched.abort(seq)   # frees its blocks (those shared with a sibling stay)
        if all(seq.is_finished for seq in seqs):
            self._do_abort(key)   # nothing of it runs any more: hand it out now
        else:
            self._publish()

    def _do_call(self, arg) -> None:
        call_id, fn = arg
        try:
            if isinstance(fn, bytes):   # from another process: a function that cannot be found here fails the call
                fn = pickle.loads(fn)
            value = (True, fn(self.engine, self.live_sequences()))
        except BaseException as e:   # (a KeyboardInterrupt or SystemExit of fn's is fn's caller's, not the loop's)
            value = (False, e)
        if call_id is not None:
            self.emit([("result", call_id, value)])

    def _do_listen(self, callback) -> None:
        self._dashboards.append(callback)
        self._publish()

    def _do_unlisten(self, callback) -> None:
        if callback in self._dashboards:
            self._dashboards.remove(callback)

    def _step(self) -> None:
        try:
            core, _ = self.engine.step_core()
        except Exception as e:
            self._on_step_fault(e)
            return
        self._faults = 0
        messages = []
        for c in core:   # what the step brought each request: nothing to diff
            request = self._requests.get(c.request_id)
            if request is None:
                continue
            if c.finished:
                self._forget(request)
            messages.append(("delta", request.key,
                             _Delta(c.new_token_ids, c.new_logprobs, c.finish_reasons, request.num_prompt_tokens,
                                    c.num_cached_tokens, c.metrics, finished=c.finished)))
        self._publish()   # first the listeners (the dashboard) see the step, then the callers get its tokens
        if messages:
            self.emit(messages)   # one message batch per step, not one per request

    def _on_step_fault(self, error: Exception) -> None:
        """A step raised and was rolled back. Retry it; if it keeps failing, fail its requests."""
        self._faults += 1
        self.num_step_faults += 1
        logger.warning("engine step failed and was rolled back (%s: %s), attempt %d",
                       type(error).__name__, error, self._faults)
        if self._faults <= self.max_step_retries:
            return
        self._faults = 0
        sched = self.engine.scheduler
        try:   # which requests does that step take? schedule it once more, then undo it
            preview = sched.schedule()
            victims = {seq.request_id for seq in preview.seqs}
            sched.unschedule(preview)
        except Exception:
            victims = set(self._requests)   # the scheduler itself fails: every request is involved
        if not victims:
            victims = set(self._requests)
        reason = EngineGenerateError(f"an engine step failed {self.max_step_retries + 1} times with this request "
                                     f"in it ({type(error).__name__}: {error}); the request was aborted")
        messages = []
        for rid in sorted(victims):
            request = self._requests.get(rid)
            try:
                self.engine.abort_request(rid)
            except KeyError:
                pass
            if request is not None:
                self._forget(request)
                messages.append(("error", request.key, reason))
        self.emit(messages)
        self._publish()

    def _fail_all(self, error: BaseException) -> None:
        messages = []
        for rid, request in list(self._requests.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
            messages.append(("error", request.key, error))
        self._requests.clear()
        self._by_key.clear()
        while True:   # requests queued after the stop command: refuse them
            try:
                command, arg = self.commands.get(block=False)
            except queue.Empty:
                break
            if command == "add":
                messages.append(("refused", arg[0], error))
            elif command == "call" and arg[0] is not None:
                messages.append(("result", arg[0], (False, error)))
        try:
            self.emit(messages)
        except Exception:   # (an engine core process whose parent has gone: nobody to tell)
            pass

    # ------------------------------------------------------------ the dashboard's feed

    def _publish(self) -> None:
        if not self._dashboards:
            return
        live = self.live_sequences()
        for callback in list(self._dashboards):
            try:
                callback(self.engine, live)
            except Exception:
                logger.exception("a step listener raised; it is removed")
                self._dashboards.remove(callback)

    def live_sequences(self) -> dict:
        """Request id (``/j`` for completion j > 0) -> each live completion's Sequence."""
        names = {}
        for request in self._requests.values():
            for seq in [request.seq] + list(request.seq.children):
                names[request.request_id + (f"/{seq.index}" if seq.index else "")] = seq
        return names


def num_waiting_beyond_seats(engine) -> int:
    """The waiting sequences the engine's next step cannot seat even if blocks allow
    (``max_num_seqs`` less those running) -- what admission control counts."""
    sched = engine.scheduler
    free_seats = max(0, sched.max_num_seqs - len(sched.running))
    return max(0, len(sched.waiting) - free_seats)


def _dead_error(errored: BaseException | None) -> EngineDeadError:
    if errored is not None:
        return EngineDeadError(f"the engine loop died ({type(errored).__name__}: {errored}); "
                               f"requests in flight were aborted")
    return EngineDeadError("the engine was shut down; requests in flight were aborted")


def _engine_info(engine) -> dict:
    """What the caller's side needs to know of an engine it may not hold."""
    return {"model": engine.engine_config.model, "max_model_len": engine.max_model_len,
            "vocab_size": engine.config.vocab_size, "max_num_seqs": engine.scheduler.max_num_seqs}


def _metrics_text(engine, live) -> bytes:
    from prometheus_client import generate_latest
    return generate_latest(engine.metrics_registry)


# ---------------------------------------------------------------- the two ways to run the core

class _CommandEncoder:
    """The caller's side of the core's input: ``put((command, arg))`` with RequestStates (what
    the output processor and the lab write), sent on in the form the core takes (keys: a
    RequestState holds an event loop and futures, which stay on this side)."""

    def __init__(self, send):
        self._send = send

    def put(self, item) -> None:
        command, arg = item
        if command == "add":
            arg = (arg.key, arg.request_id, arg.engine_prompt, arg.sampling_params)
        elif command == "abort":
            arg = arg.key
        elif command == "stop_completions":
            arg = (arg[0].key, list(arg[1]))
        self._send((command, arg))


class _ThreadClient:
    """The engine core on a thread of this process (the default)."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.commands = _CommandEncoder(self._queue.put)
        self.core = EngineCore(llm.engine, self._queue, llm._deliver, max_waiting=llm.max_waiting,
                               max_step_retries=llm.max_step_retries)
        self._thread = threading.Thread(target=self._run, name="course-engine-core", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self.core.run()
        finally:
            self.llm._core_stopped(self.core.errored)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def require_thread_core(self, what: str) -> None:
        pass

    def stop(self, timeout: float) -> bool:
        if self._thread.is_alive():
            self._queue.put(("stop", None))
            self._thread.join(timeout)
        return not self._thread.is_alive()


class _CommandPipe:
    """The core's input in an engine core process: its end of the pipe, read as a queue. When
    the server's process has gone (the pipe ends), the next read says "stop"; after that a
    blocking read says it again and any other finds nothing."""

    def __init__(self, conn):
        self.conn = conn
        self.ended = False

    def get(self, block: bool = True):
        while not self.ended:
            try:
                if not block and not self.conn.poll():
                    raise queue.Empty
                return self.conn.recv()
            except (EOFError, OSError):
                self.ended = True
                return ("stop", None)
            except queue.Empty:
                raise
            except Exception:   # (a command that cannot be unpickled here: the caller's side checks for this)
                logger.exception("a command from the server's process could not be read; it is dropped")
        if block:
            return ("stop", None)
        raise queue.Empty


def _engine_core_process(conn, model, engine_kwargs: dict, max_waiting, max_step_retries, num_threads) -> None:
    """The engine core process: build the engine, say what it is, run the loop, close the engine."""
    import gc
    import signal as _signal_module

    import torch

    from course_pkg.engine.llm_engine import LLMEngine

    torch.set_num_threads(num_threads)   # as many as the server's process was given
    _signal_module.signal(_signal_module.SIGINT, _signal_module.SIG_IGN)   # Ctrl-C is the server's to handle
    try:
        try:
            engine = LLMEngine(model, **engine_kwargs)
        except BaseException as e:
            conn.send(("failed", _picklable(e)))
            return
        conn.send(("ready", _engine_info(engine)))
        gc.collect()   # (as the server's process does after start-up: see serve.__main__.freeze_gc_heap)
        gc.freeze()
        core = EngineCore(engine, _CommandPipe(conn), lambda messages: conn.send(_picklable_messages(messages)),
                          max_waiting=max_waiting, max_step_retries=max_step_retries)
        core.run()
        if core.errored is not None:   # (its requests were told already; this is for what comes after)
            conn.send([("died", None, _picklable(core.errored))])
        engine.close()
        conn.close()
    finally:
        # Leave without the interpreter's clean-up: it has nothing left to save here, and it
        # would print the native extensions' complaints about objects alive at exit (Triton's
        # nanobind) into the server's log -- or the notebook cell -- that shares this stderr.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _picklable(error: BaseException) -> BaseException:
    """``error``, or a RuntimeError saying what it was if it would not come out of a pickle whole."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _picklable_messages(messages: list[tuple]) -> list[tuple]:
    """The messages, each exception and call result replaced by an error saying what it was if
    it would not survive the pipe (a delta is plain data: it always does)."""
    out = []
    for kind, key, payload in messages:
        if kind == "result":
            try:
                pickle.loads(pickle.dumps(payload))
            except Exception as e:
                payload = (False, TypeError(f"the call's result does not pickle ({type(e).__name__}: {e}); with "
                                            f"engine_core_process=True it must"))
        elif isinstance(payload, BaseException):
            payload = _picklable(payload)
        out.append((kind, key, payload))
    return out


class _ProcessClient:
    """The engine core in a process of its own (vLLM's ``EngineCoreProc``): commands go down a
    pipe; a thread of this process reads what comes back and hands it to ``_deliver``."""

    def __init__(self, llm: AsyncLLM, model, engine_kwargs: dict):
        import multiprocessing

        import torch

        self.llm = llm
        ctx = multiprocessing.get_context("spawn")   # (a fresh interpreter: no forked threads or torch state)
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()   # sends come from the event loop and from any thread that aborts
        self.commands = _CommandEncoder(self._send)
        self._process = ctx.Process(target=_engine_core_process, name="course-engine-core", daemon=True,
                                    args=(child, model, engine_kwargs, llm.max_waiting, llm.max_step_retries,
                                          torch.get_num_threads()))
        self._process.start()
        child.close()   # (so that the pipe reports the child's end when it exits)
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the engine core process exited while starting (exit code "
                               f"{self._process.exitcode}; its error is printed above -- a script that starts "
                               f"one must do it under `if __name__ == '__main__':`)") from None
        if kind == "failed":
            self._process.join()
            raise payload
        self.info = payload
        self._reader = threading.Thread(target=self._read, name="course-engine-core-output", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def _send(self, item) -> None:
        """Pickle and send one command. Raises (and sends nothing) if it does not pickle; a
        function to call travels as its pickle, unpickled by the core inside the call."""
        command, arg = item
        if command == "call":
            try:
                item = (command, (arg[0], pickle.dumps(arg[1])))
            except Exception as e:
                raise TypeError(f"with engine_core_process=True the function runs in the engine's process "
                                f"and must pickle (define it in a module): {e}") from None
        with self._lock:
            try:
                self._conn.send(item)
            except OSError:   # the core has gone; the reader fails what is left
                pass

    def _read(self) -> None:
        try:
            while True:
                try:
                    messages = self._conn.recv()
                except (EOFError, OSError):   # the core's process has closed its end: it is exiting
                    break
                except Exception:   # (the core sends only what survives a pickle; never seen)
                    logger.exception("a message from the engine core could not be read; it is dropped")
                    continue
                self.llm._deliver(messages)
        finally:
            self._process.join(5)   # (only this thread joins it)
            self.llm._core_stopped(None if self.llm._stopping else
                                   RuntimeError(f"the engine core process exited (exit code {self._process.exitcode})"))

    def is_alive(self) -> bool:
        return self._reader.is_alive()   # (it ends when the core's process has gone)

    def require_thread_core(self, what: str) -> None:
        raise RuntimeError(f"{what}: needs the engine core on a thread of this process, not available with "
                           f"engine_core_process=True")

    def stop(self, timeout: float) -> bool:
        if self._reader.is_alive():
            self._send(("stop", None))
            self._reader.join(timeout)   # it ends once the core's process has closed the pipe
        if not self._reader.is_alive() and self._process.is_alive():   # (a process that outlived its pipe)
            self._process.terminate()
            self._process.join(timeout)
        return not self._reader.is_alive()


def _copy_metrics(metrics: RequestMetrics) -> RequestMetrics:
    return replace(metrics, inter_token_latencies=list(metrics.inter_token_latencies),
                   token_steps=list(metrics.token_steps))


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _check_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, SequenceABC) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("a stop string must not be empty")
    return tuple(stop)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str | None]:
    """The first position where a stop string occurs in ``text`` (searched from ``start``)."""
    best, which = len(text), None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and i < best:
            best, which = i, s
    return best, which
