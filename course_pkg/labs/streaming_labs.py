"""Chapter 13 lab: the output processor of ``AsyncLLM`` -- the stub and the mutants. A module of
its own because it imports the engine package (and so torch), which the block labs do not need.

The output processor runs on the caller's side. After each step the engine core sends every
request a ``_Delta``: per completion, the token ids the step appended and their log-probabilities,
the finish reasons the engine decided, and whether the engine is done with the request. The
processor turns that into text, ends a completion at a stop string (and tells the engine to stop
generating it), and shapes the ``RequestOutput`` that ``RequestOutputKind`` asks for.
"""
from __future__ import annotations

from course_pkg.engine.async_llm import AsyncLLM, RequestOutputKind, RequestState, _Delta
from course_pkg.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


class StudentAsyncLLM(AsyncLLM):
    """Lab ``output_processor``: assemble a streamed completion from the engine's deltas.

    What you may use: ``self.tokenizer`` (``decode(ids, skip_special_tokens=True)``; None when
    the model has none: then every ``text`` is None), ``self._commands`` (what goes to the
    engine core: ``put(("stop_completions", (state, [indices])))`` stops those completions in
    the engine), and, if you like, the module's ``_find_stop(text, stops, start)``.
    A ``RequestState`` holds ``request_id``, ``prompt``, ``seq_prompt_ids``, ``stop`` (a tuple
    of strings), ``output_kind``, ``completions`` (one ``_Completion`` per index) and the fields
    set below; a ``_Completion`` holds ``index``, ``token_ids``, ``logprobs``, ``text``,
    ``sent_text`` / ``sent_tokens`` (what DELTA outputs already handed out), ``finish_reason``,
    ``stop_reason`` and ``delta_done``.
    """

    def _process(self, state: RequestState, d: _Delta) -> RequestOutput | None:
        """Take one delta into ``state`` and return the output to hand out now, or None.

        Set ``state.prompt_token_ids`` (from ``state.seq_prompt_ids`` the first time),
        ``state.num_cached_tokens``, ``state.metrics`` (keep the old one when the delta has
        none) and ``state.engine_done`` (``d.finished``). For every completion not finished yet:
        append its new tokens and log-probabilities; decode all its tokens to ``text``; if a
        stop string occurs in the text, cut the text where the first one begins (of two that
        begin at the same place, the one listed first in ``state.stop``), and finish the
        completion with reason ``"stop"`` and ``stop_reason`` that string; otherwise take the
        engine's finish reason, if any. A finished completion takes no more tokens. When the
        engine is done (``d.finished``) a completion still unfinished was aborted: ``"abort"``.
        ``state.finished`` is whether every completion has a reason. If a completion ended on a
        stop string while the request goes on (not finished, engine not done), put the
        ``stop_completions`` command with the indices that stopped in this delta. Return
        ``self._make_output(state, final=state.finished)``.
        """
        ...

    def _make_output(self, state: RequestState, final: bool) -> RequestOutput | None:
        """The ``RequestOutput`` to hand out now (vLLM's ``RequestOutputKind``), or None.

        ``FINAL_ONLY``: None until ``final``. A completion's text may still change while it is
        unfinished, so hand out of it only what is settled: not a trailing ``"\\ufffd"`` (a
        character whose bytes span two tokens) and not the last ``max(len(s) for s in
        state.stop) - 1`` characters (a stop string that begins there would cut them; vLLM's
        ``stop_buffer_length``) -- and never less than was handed out already. A finished
        completion is settled whole. ``CUMULATIVE``: every completion, its settled text, all its
        tokens and log-probabilities. ``DELTA``: per completion only what is new since its last
        output (text, tokens, log-probabilities); leave out a completion with nothing new, unless
        this is the output that carries its finish reason (sent once). ``cumulative_logprob`` is
        the sum of all its log-probabilities. None if no completion has anything to hand out;
        else ``RequestOutput(request_id, prompt, prompt_token_ids, outputs, num_cached_tokens,
        metrics (a ``RequestMetrics(0.0)`` while there is none), finished=final)``.
        """
        ...


# ---------------------------------------------------------------- mutants


class _DroppingQueue:
    def __init__(self, queue):
        self.queue = queue

    def put(self, item):
        if item[0] != "stop_completions":
            self.queue.put(item)


class NoStopCommandAsyncLLM(AsyncLLM):
    """Ends a completion at its stop string but never tells the engine: it keeps generating."""

    def _process(self, state, d):
        commands = self._commands
        self._commands = _DroppingQueue(commands)
        try:
            return super()._process(state, d)
        finally:
            self._commands = commands


class NoStopHoldBackAsyncLLM(AsyncLLM):
    """Hands out text a stop string may still cut (no stop buffer)."""

    def _make_output(self, state, final):
        stop = state.stop
        state.stop = ()
        try:
            return super()._make_output(state, final)
        finally:
            state.stop = stop


class ReplacementCharacterAsyncLLM(AsyncLLM):
    """Holds back for stop strings but not a trailing U+FFFD: a character whose bytes span two
    tokens goes out half-decoded."""

    def _make_output(self, state, final):
        kind = state.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not final:
            return None
        outputs = []
        hold = max(map(len, state.stop), default=1) - 1
        for c in state.completions:
            ready = len(c.text) if c.finish_reason is not None else max(c.sent_text, len(c.text) - hold)
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


class AbortUnmarkedAsyncLLM(AsyncLLM):
    """A request the engine aborted ends with no finish reason: its caller never learns it ended."""

    def _process(self, state, d):
        if d.finished and any(c.finish_reason is None and c.index not in d.finish_reasons
                              for c in state.completions):
            d = _Delta(d.new_token_ids, d.new_logprobs, d.finish_reasons, d.num_prompt_tokens,
                       d.num_cached_tokens, d.metrics, finished=False)
        return super()._process(state, d)


class TokensAfterStopAsyncLLM(AsyncLLM):
    """Keeps appending the tokens a completion gets after it ended on a stop string."""

    def _process(self, state, d):
        for c in state.completions:
            if c.finish_reason == "stop" and c.stop_reason is not None:
                c.token_ids += d.new_token_ids.get(c.index, [])
                c.logprobs += d.new_logprobs.get(c.index, [])
        return super()._process(state, d)


class ResendingDeltaAsyncLLM(AsyncLLM):
    """DELTA outputs repeat the whole text so far instead of what is new."""

    def _make_output(self, state, final):
        if state.output_kind is RequestOutputKind.DELTA:
            for c in state.completions:
                c.sent_text = 0
        return super()._make_output(state, final)
