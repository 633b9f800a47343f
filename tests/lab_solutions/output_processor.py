"""A correct solution of lab `output_processor`, written from the chapter and the stub's contract,
not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs output_processor tests/lab_solutions/output_processor.py``.
"""
from __future__ import annotations

from course_pkg.engine.async_llm import AsyncLLM, RequestOutputKind
from course_pkg.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


class WholeTextAsyncLLM(AsyncLLM):
    """Decodes each completion whole after every delta and looks for the stop strings in all of it."""

    def _process(self, state, d):
        if not state.prompt_token_ids:
            state.prompt_token_ids = list(state.seq_prompt_ids)
        state.num_cached_tokens = d.num_cached_tokens
        if d.metrics is not None:
            state.metrics = d.metrics
        state.engine_done = d.finished
        newly_stopped = []
        for c in state.completions:
            if c.finish_reason is not None:
                continue
            c.token_ids = c.token_ids + list(d.new_token_ids.get(c.index, []))
            c.logprobs = c.logprobs + list(d.new_logprobs.get(c.index, []))
            if self.tokenizer is not None:
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                hits = [(text.find(s), k, s) for k, s in enumerate(state.stop) if s in text]
                if hits:
                    at, _, which = min(hits)
                    text = text[:at]
                    c.finish_reason, c.stop_reason = "stop", which
                    newly_stopped.append(c.index)
                c.text = text
            if c.finish_reason is None and c.index in d.finish_reasons:
                c.finish_reason = d.finish_reasons[c.index]
        if d.finished:
            for c in state.completions:
                if c.finish_reason is None:
                    c.finish_reason = "abort"
        state.finished = all(c.finish_reason is not None for c in state.completions)
        if newly_stopped and not state.finished and not state.engine_done:
            self._commands.put(("stop_completions", (state, newly_stopped)))
        return self._make_output(state, final=state.finished)

    def _settled(self, state, c) -> int:
        """How many characters of ``c.text`` may go out now."""
        if c.finish_reason is not None:
            return len(c.text)
        end = len(c.text)
        while end and c.text[end - 1] == "\ufffd":
            end -= 1
        if state.stop:
            end -= max(len(s) for s in state.stop) - 1
        return max(end, c.sent_text)

    def _make_output(self, state, final):
        if state.output_kind is RequestOutputKind.FINAL_ONLY and not final:
            return None
        delta = state.output_kind is RequestOutputKind.DELTA
        outputs = []
        for c in state.completions:
            settled = self._settled(state, c)
            if delta:
                if c.delta_done:
                    continue
                text = c.text[c.sent_text:settled]
                tokens, lps = c.token_ids[c.sent_tokens:], c.logprobs[c.sent_tokens:]
                if not text and not tokens and c.finish_reason is None:
                    continue
                c.sent_text, c.sent_tokens = settled, len(c.token_ids)
                if c.finish_reason is not None:
                    c.delta_done = True
            else:
                text, tokens, lps = c.text[:settled], list(c.token_ids), list(c.logprobs)
            outputs.append(CompletionOutput(
                index=c.index, text=None if self.tokenizer is None else text, token_ids=list(tokens),
                cumulative_logprob=sum(c.logprobs), finish_reason=c.finish_reason, logprobs=list(lps),
                stop_reason=c.stop_reason))
        if not outputs:
            return None
        metrics = state.metrics if state.metrics is not None else RequestMetrics(0.0)
        return RequestOutput(state.request_id, state.prompt, list(state.prompt_token_ids), outputs,
                             state.num_cached_tokens, metrics, finished=final)


StudentAsyncLLM = WholeTextAsyncLLM
