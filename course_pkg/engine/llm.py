"""``LLM``: the offline entry point, ``LLM(model).generate(prompts, sampling_params)`` (chapter 06).

As in vLLM and Nano-vLLM, ``generate`` takes a batch of prompts, runs engine steps until every
one has finished, and returns one output per prompt, in the order of the prompts -- even
though requests finish in another order, batched together with whatever else is running.

``generate`` steps the whole engine, so requests it did not submit (queued earlier with
``add_request``, or left behind by an interrupted ``generate``) may finish during it. Their
outputs are never dropped: ``generate`` files them in ``llm.unclaimed_outputs`` (request id ->
output), where their owner picks them up, as vLLM's ``step()`` hands every finished request
to its caller.
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import replace

from course_pkg.beam_search import BeamSearchOutput
from course_pkg.engine.llm_engine import LLMEngine, beam_root_params
from course_pkg.engine.outputs import RequestOutput
from course_pkg.sampling_params import BeamSearchParams, SamplingParams
from course_pkg.validation import check_bool, is_int


def _as_prompt_list(prompts) -> list:
    """One prompt (text, a list of token ids, a prompt dict) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise TypeError("prompts must be a string, a list of token ids, or a list of those; got bytes "
                        "(decode them to a str first)")
    if not isinstance(prompts, SequenceABC):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; "
                        f"got {type(prompts).__name__}")
    if prompts and all(is_int(t) for t in prompts):
        return [list(prompts)]                      # a single prompt given as token ids
    return list(prompts)


class LLM(LLMEngine):
    """``LLM(model=None, block_size=16, num_kvcache_blocks=..., enable_prefix_caching=True, ...)``.

    ``model=None`` loads the tiny default model that ships with the package; a path to a
    Hugging Face Qwen3 checkpoint folder (e.g. Qwen3-0.6B) loads that one. All keyword
    arguments are :class:`LLMEngine`'s.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Finished outputs that a generate() call received but did not submit; nothing else
        # reads them, so they wait here until their owner pops them.
        self.unclaimed_outputs: dict[int, RequestOutput] = {}

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns their outputs in prompt order.

        Every prompt is validated before any is queued, so a bad prompt raises
        ``ValueError`` and leaves the engine exactly as it was. Other requests that finish
        meanwhile go to ``self.unclaimed_outputs``. If a step raises (or the run is
        interrupted), the requests this call submitted are aborted -- their blocks freed --
        and the exception propagates; outputs it had already received go to
        ``self.unclaimed_outputs``, so nothing finished is lost. Not thread-safe: a second
        thread calling in meanwhile gets a ``RuntimeError``.
        """
        check_bool("use_tqdm", use_tqdm)
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        with self._exclusive():
            seqs = []
            for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
                try:
                    if not isinstance(prompt, (str, list, tuple, dict)):
                        raise TypeError(f"a prompt is a str, a list of token ids or a prompt dict, got "
                                        f"{type(prompt).__name__} {prompt!r}")
                    seqs.append(self.make_sequence(prompt, sp))
                except (ValueError, TypeError) as e:
                    raise type(e)(f"prompt {i}: {e}") from None
            ids = self._add_all(seqs, prompts)
            pending = set(ids)
            outputs: dict[int, RequestOutput] = {}
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(ids), desc="Generating", dynamic_ncols=True)
            received: list[RequestOutput] = []   # handed out by step(), not yet sorted
            try:
                while pending:
                    received += self.step()
                    while received:
                        out = received[0]
                        if out.request_id in pending:
                            outputs[out.request_id] = out
                            pending.discard(out.request_id)
                            if bar is not None:
                                bar.update(1)
                        else:                                   # someone else's request
                            self.unclaimed_outputs[out.request_id] = out
                        del received[0]
            except BaseException:
                self._abandon(pending, outputs, received)
                raise
            finally:
                if bar is not None:
                    bar.close()
            self.flush_kv_transfer()   # (a tier stores a step's blocks in the next step: make those now)
            return [outputs[i] for i in ids]

    def _abandon(self, pending: set[int], outputs: dict[int, RequestOutput], received: list[RequestOutput]) -> None:
        """After a failure: keep the outputs received, abort the requests still pending."""
        self.unclaimed_outputs.update(outputs)
        self.unclaimed_outputs.update((o.request_id, o) for o in received)
        for request_id in sorted(pending - set(self.unclaimed_outputs)):
            try:
                self.abort_request(request_id)
            except Exception:   # keep aborting the others; the original error is re-raised
                pass

    def beam_search(self, prompts, params: BeamSearchParams, on_step=None) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``), one prompt after another.

        Each search is a request of the engine's step loop (``add_beam_search``): its beams are
        forked sequences that share their blocks, ranked in ``update_from_output``; see
        :mod:`course_pkg.beam_search`. The engine must have no other requests (a search runs
        alone). Every prompt is checked first: a prompt whose ``beam_width`` beams could never
        fit in the pool together raises ``ValueError`` before anything runs.

        ``on_step(BeamStep, beams)`` is called after every step of a search with the beams that
        go on (none after its last step), for the chapter's drawings. If anything raises -- the
        callback, a fault, an interrupt -- the search is aborted, every block released, and the
        exception propagates.
        """
        self._check_beam_search_params(params)
        if self.speculative_config is not None:
            raise ValueError("beam_search is not supported with speculative decoding (speculative_config): "
                             "its beams are scored one token at a time; use an engine without it")
        prompts = _as_prompt_list(prompts)
        with self._exclusive():
            if self.has_unfinished_requests():
                raise RuntimeError("beam_search runs alone: finish or abort the queued requests first")
            for i, prompt in enumerate(prompts):
                try:
                    self.scheduler.check_beam_search(self.make_sequence(prompt, beam_root_params(params)), params)
                except (ValueError, TypeError) as e:
                    raise type(e)(f"prompt {i}: {e}") from None
            return [self._beam_search_one(prompt, params, on_step) for prompt in prompts]

    def _beam_search_one(self, prompt, params: BeamSearchParams, on_step) -> BeamSearchOutput:
        seq = self.make_sequence(prompt, beam_root_params(params))
        request_id, output, seen = seq.request_id, None, 0
        try:
            self._add_beam_search(seq, params, prompt)   # (inside: a fault after it is queued aborts it)
            search = self._requests[request_id].beam_search
            while output is None:
                for out in self.step():   # (the search runs alone: the only output is its own)
                    output = out
                if on_step is not None:
                    for step in search.steps[seen:]:
                        on_step(step, list(search.beams))
                    seen = len(search.steps)
        except BaseException:
            if request_id in self._requests or request_id in self._outbox:
                self.abort_request(request_id)
            raise
        return BeamSearchOutput(sequences=[replace(h, text=c.text) for h, c in zip(search.finished, output.outputs)])

