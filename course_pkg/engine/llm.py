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

from course_pkg.engine.beam_search import BeamSearchOutput, beam_search_one
from course_pkg.engine.llm_engine import LLMEngine
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

        The beams of a prompt are forked sequences that share their blocks; see
        :mod:`course_pkg.engine.beam_search`. The engine must have no other requests (beam
        search does not interleave with ``generate``). Every prompt is checked first: a prompt
        whose ``beam_width`` beams could never fit in the pool together raises ``ValueError``
        before anything runs.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if self.speculative_config is not None:
            raise ValueError("beam_search is not supported with speculative decoding (speculative_config): "
                             "its beams are scored one token at a time; use an engine without it")
        prompts = _as_prompt_list(prompts)
        with self._exclusive():
            if self.has_unfinished_requests():
                raise RuntimeError("beam_search runs alone: finish or abort the queued requests first")
            as_n = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                                  n=params.beam_width)
            if params.beam_width > self.config.vocab_size:
                raise ValueError(f"beam_width={params.beam_width} is more than the vocabulary's "
                                 f"{self.config.vocab_size} tokens: a step could not fill the beams")
            roots = []
            for i, prompt in enumerate(prompts):
                try:
                    seq = self.make_sequence(prompt, as_n)   # a request of beam_width completions
                    self.scheduler.check(seq)
                    if seq.num_prompt_tokens + params.max_tokens > self.max_model_len:
                        raise ValueError(f"the prompt's {seq.num_prompt_tokens} tokens plus max_tokens="
                                         f"{params.max_tokens} exceed max_model_len={self.max_model_len}")
                except (ValueError, TypeError) as e:
                    raise type(e)(f"prompt {i}: {e}") from None
                roots.append((seq.token_ids, seq.cache_salt))
            return [beam_search_one(self, ids, params, on_step, cache_salt=salt) for ids, salt in roots]
