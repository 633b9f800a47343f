"""``AsyncLLM``: the engine behind a server -- one loop steps it, callers stream (chapter 13).

``LLM.generate`` takes a list and returns when every request is done. A server receives
requests one at a time, at any moment, and wants each one's tokens as soon as they exist.
vLLM v1 puts an *engine core* loop between the two, and ``AsyncLLM`` (vLLM's name) is this
course's version of it::

    callers (asyncio)               input queue            engine thread (owns the LLMEngine)
    generate(prompt) ── add ──────────> [add, abort] ──>   while work exists:
      async for out in ...:                                    add_request / abort_request
        <── RequestOutput ── output processor <── tokens ──     step()   (a transaction)
                (detokenize, stop strings,                     new tokens of every request
                 DELTA / CUMULATIVE / FINAL_ONLY)

* **One thread owns the engine.** ``LLMEngine`` serves one thread at a time; here every
  ``add_request``, ``abort_request`` and ``step`` runs on the engine thread, which takes
  commands from a queue between steps and sleeps on it when nothing is left to do. The core's
  semantics are untouched: the loop is a caller of ``add_request``/``step``/``abort_request``.
* **Tokens out after every step.** ``LLMEngine.step_core`` returns what the step brought each
  request (vLLM's ``EngineCoreOutput``: new token ids and their log-probabilities per
  completion, finish reasons), and the engine thread sends that to the caller's event loop; the *output processor* on that
  side turns them into text, finds stop strings and shapes the output as vLLM's
  ``RequestOutputKind`` asks: ``DELTA`` (what is new), ``CUMULATIVE`` (everything so far) or
  ``FINAL_ONLY``. (In vLLM the processor runs in the API-server process and the engine core in
  another, linked by ZMQ; here a thread and ``loop.call_soon_threadsafe`` play those parts.)
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
import logging
import queue
import threading
import time
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
    """What the engine thread sends after a step, per request (vLLM's ``EngineCoreOutput``)."""

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
    """One request as both sides see it: the engine thread's ids, the caller's queue and the
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
        # Engine thread only:
        self.engine_id: int | None = None
        self.seq = None                          # the request's first Sequence (forks hang from it)
        self.seq_prompt_ids: list[int] = []
        # Output processor only:
        self.completions = [_Completion(i) for i in range(sampling_params.n)]
        self.prompt_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.metrics: RequestMetrics | None = None
        self.finished = False        # every completion has its finish reason
        self.engine_done = False     # the engine has handed the request out (or aborted it)

    def put(self, item) -> None:
        """From the engine thread: hand ``item`` (a _Delta or an exception) to the caller's loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # the caller's event loop is closed: nobody is listening any more
            pass


class AsyncLLM:
    """An ``LLMEngine`` stepped by a background thread, streamed from asyncio.

    ``AsyncLLM(model=None, max_waiting=None, max_step_retries=1, **engine_kwargs)`` builds the
    engine (the keyword arguments are :class:`EngineConfig`'s) and starts the loop;
    ``AsyncLLM.from_engine(engine)`` wraps one already built (the loop then owns it: nothing
    else may call it). ``max_waiting`` (at least 1) bounds the waiting queue: a request is
    refused with :class:`QueueFullError` (a server's 503) when that many requests already wait
    *beyond the free running seats* (``max_num_seqs`` less the sequences running) -- a request
    the next step can admit does not count as waiting.
    Use ``async for out in llm.generate(prompt, params): ...``; call ``shutdown()`` at the end.
    """

    def __init__(self, model=None, *, max_waiting: int | None = None, max_step_retries: int = 1,
                 engine=None, **engine_kwargs):
        from course_pkg.engine.llm_engine import LLMEngine
        from course_pkg.models import default_model_path, load_tokenizer
        from course_pkg.validation import check_int

        if max_waiting is not None:
            check_int("max_waiting", max_waiting, minimum=1)
        check_int("max_step_retries", max_step_retries, minimum=0)
        self.engine = engine if engine is not None else LLMEngine(model, **engine_kwargs)
        self.max_waiting = max_waiting
        self.max_step_retries = max_step_retries
        cfg_model = self.engine.engine_config.model
        self.model_path = default_model_path() if cfg_model is None else cfg_model
        self.model_name = "course-tiny" if cfg_model is None else Path(cfg_model).name   # as the metrics label it
        # The output processor's own tokenizer: the engine thread may be decoding with its own
        # at the same moment (vLLM's API server also holds a tokenizer of its own).
        self.tokenizer = load_tokenizer(self.model_path)
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._states: dict[int, RequestState] = {}      # engine id -> state (engine thread only)
        self._by_request_id: dict[str, RequestState] = {}
        self._dashboards: list = []                      # callbacks fed a snapshot after each step
        self._faults = 0
        self.num_step_faults = 0
        self.errored: BaseException | None = None        # why the loop died, if it did
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="course-engine-core", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine(cls, engine, **kwargs) -> "AsyncLLM":
        return cls(engine=engine, **kwargs)

    # ------------------------------------------------------------ the caller's side

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, *, stop: SequenceABC[str] | str | None = None,
                          output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> RequestState:
        """Queue a request on the engine thread; returns once it is queued or refused.

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
        self._by_request_id[request_id] = state
        self._commands.put(("add", state))
        if self._stopping or not self._thread.is_alive():
            # The loop may have stopped between the check above and the put, after its last
            # look at the queue: nobody would answer this add. (If it did see it, the answer
            # it sends later finds the future done and is dropped.)
            _set_exception(state.added, self._dead())
        try:
            await state.added
        except BaseException:
            self._by_request_id.pop(request_id, None)
            refused = state.added.done() and not state.added.cancelled() and state.added.exception() is not None
            if not refused:   # cancelled while queued: this abort runs after the add, and undoes it
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
        async for out in self.outputs(state):
            yield out

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
        """``fn(engine, live_sequences)`` run on the engine thread between steps; returns its
        result (blocks the calling thread). ``live_sequences`` maps a name to each live
        completion's Sequence (what the dashboard draws)."""
        result: queue.SimpleQueue = queue.SimpleQueue()
        if not self.is_running:
            raise self._dead()
        self._commands.put(("call", (fn, result)))
        ok, value = result.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def call_in_engine_thread_nowait(self, fn) -> None:
        """``fn(engine, live_sequences)`` queued for the engine thread; its result is dropped."""
        self._commands.put(("call", (fn, None)))

    def add_step_listener(self, callback) -> None:
        """``callback(engine, live_sequences)`` runs on the engine thread now and after every
        step, add and abort (the dashboard's feed). It must be quick and must not raise; one
        that raises is removed."""
        self._commands.put(("listen", callback))

    def remove_step_listener(self, callback) -> None:
        self._commands.put(("unlisten", callback))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests in flight are aborted and their callers get EngineDeadError.

        Waits up to ``timeout`` seconds for the loop to finish its step. If it has not, raises
        ``TimeoutError`` and leaves the engine open (closing it under a running step would pull
        its workers from under the forward pass); call ``shutdown()`` again to finish.
        """
        self._stopping = True      # from now on add_request refuses
        if self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine loop did not stop within {timeout} s (a step is still "
                               f"running); the engine was left open: call shutdown() again")
        self._fail_all(self._dead())   # anything queued after the loop's own last drain
        if not self._closed:
            self._closed = True
            self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _dead(self) -> EngineDeadError:
        if self.errored is not None:
            return EngineDeadError(f"the engine loop died ({type(self.errored).__name__}: {self.errored}); "
                                   f"requests in flight were aborted")
        return EngineDeadError("the engine was shut down; requests in flight were aborted")

    # ------------------------------------------------------------ the output processor

    def _process(self, state: RequestState, d: _Delta) -> RequestOutput | None:
        """Tokens from the engine thread -> text, stop strings, the output kind. Caller's thread."""
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

    # ------------------------------------------------------------ the engine thread

    def _run(self) -> None:
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
            self._stopping = True
            self._fail_all(self._dead())

    def _drain(self, block: bool) -> bool:
        """Run the queued commands; wait for one if ``block``. False once told to stop."""
        while True:
            try:
                command, arg = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command == "stop":
                return False
            getattr(self, f"_do_{command}")(arg)

    def _do_add(self, state: RequestState) -> None:
        engine = self.engine
        try:
            if self.max_waiting is not None and self.num_waiting_beyond_seats() >= self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests wait beyond "
                                     f"the free seats): try again later")
            rid = engine.add_request(state.engine_prompt, state.sampling_params)
        except Exception as e:
            state.loop.call_soon_threadsafe(_set_exception, state.added, e)
            return
        state.engine_id, state.seq = rid, engine.get_sequence(rid)
        state.seq_prompt_ids = list(state.seq.prompt_token_ids)
        self._states[rid] = state
        state.loop.call_soon_threadsafe(_set_result, state.added, rid)
        self._publish()

    def num_waiting_beyond_seats(self) -> int:
        """Engine thread: the waiting sequences the next step cannot seat even if blocks allow
        (``max_num_seqs`` less those running) -- what admission control counts."""
        sched = self.engine.scheduler
        free_seats = max(0, sched.max_num_seqs - len(sched.running))
        return max(0, len(sched.waiting) - free_seats)

    def _do_abort(self, state: RequestState) -> None:
        if state.engine_id is None or self._states.pop(state.engine_id, None) is None:
            return   # never queued, or already handed out
        try:
            out = self.engine.abort_request(state.engine_id)
        except KeyError:
            out = None
        # The caller's generate() (if it still listens) ends with finish_reason "abort". Every token
        # went out with the step that made it: only the finish reasons are new.
        if out is None:
            state.put(_Delta({}, {}, {}, len(state.seq_prompt_ids), 0, None, True))
        else:
            state.put(_Delta({}, {}, {c.index: c.finish_reason for c in out.outputs}, len(state.seq_prompt_ids),
                             out.num_cached_tokens, _copy_metrics(out.metrics), True))
        self._publish()

    def _do_stop_completions(self, arg) -> None:
        """Abort some completions of a request (they ended on stop strings); the rest go on."""
        state, indices = arg
        if state.engine_id is None or state.engine_id not in self._states:
            return   # never queued, or already handed out
        sched = self.engine.scheduler
        for seq in [state.seq] + list(state.seq.children):
            if seq.index in indices and sched.holds(seq):
                sched.abort(seq)   # frees its blocks (those shared with a sibling stay)
        if all(seq.is_finished for seq in [state.seq] + list(state.seq.children)):
            self._do_abort(state)   # nothing of it runs any more: hand it out now
        else:
            self._publish()

    def _do_call(self, arg) -> None:
        fn, result = arg
        try:
            value = (True, fn(self.engine, self.live_sequences()))
        except BaseException as e:   # (a KeyboardInterrupt or SystemExit of fn's is fn's caller's, not the loop's)
            value = (False, e)
        if result is not None:
            result.put(value)

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
        deltas = []
        for c in core:   # what the step brought each request: nothing to diff
            state = self._states.get(c.request_id)
            if state is None:
                continue
            if c.finished:
                del self._states[c.request_id]
            deltas.append((state, _Delta(c.new_token_ids, c.new_logprobs, c.finish_reasons, len(state.seq_prompt_ids),
                                         c.num_cached_tokens, c.metrics, finished=c.finished)))
        self._publish()   # first the listeners (the dashboard) see the step, then the callers get its tokens
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for state, delta in deltas:   # one wake-up of each caller's loop per step, not one per request
            by_loop.setdefault(state.loop, []).append((state.queue, delta))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # that event loop is closed: nobody is listening any more
                pass

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
            victims = set(self._states)   # the scheduler itself fails: every request is involved
        if not victims:
            victims = set(self._states)
        reason = EngineGenerateError(f"an engine step failed {self.max_step_retries + 1} times with this request "
                                     f"in it ({type(error).__name__}: {error}); the request was aborted")
        for rid in sorted(victims):
            state = self._states.pop(rid, None)
            try:
                self.engine.abort_request(rid)
            except KeyError:
                pass
            if state is not None:
                state.put(reason)
        self._publish()

    def _fail_all(self, error: BaseException) -> None:
        for rid, state in list(self._states.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
            state.put(error)
        self._states.clear()
        while True:   # requests queued after the stop command: refuse them
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                arg.loop.call_soon_threadsafe(_set_exception, arg.added, error)
            elif command == "call" and arg[1] is not None:
                arg[1].put((False, error))

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
        """Engine thread: request id (``/j`` for completion j > 0) -> its live Sequence."""
        names = {}
        for state in self._states.values():
            for seq in [state.seq] + list(state.seq.children):
                names[state.request_id + (f"/{seq.index}" if seq.index else "")] = seq
        return names


def _put_all(items: list[tuple[asyncio.Queue, _Delta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


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
