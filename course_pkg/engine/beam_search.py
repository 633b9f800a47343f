"""Beam search on forked sequences (chapter 08): beams share blocks, pruned beams free theirs.

One prompt at a time, every step:

1. one forward pass over the live beams gives each beam's next-token log-probabilities;
2. every (beam, token) pair is a candidate scored ``beam score + log p(token)``; the best
   ``2 * beam_width`` are kept, best first;
3. a candidate that ends a hypothesis (the end-of-sequence token, or the last allowed token)
   and ranks among the first ``beam_width`` becomes a *finished hypothesis*, ranked by
   ``score / generated_length ** length_penalty``; the best ``beam_width`` candidates that do
   not end go on as the next beams;
4. the next beams are made from the old ones with the block manager: a beam chosen once
   keeps its sequence, a beam chosen ``m`` times is forked ``m - 1`` times (its blocks are
   shared, the partial last one too), a beam not chosen is released. Appending the new token
   to a shared partial block is a copy-on-write.

Search stops when the last token is reached, or when no running beam can still beat the
worst of ``beam_width`` finished hypotheses (``early_stopping=False`` in Hugging Face's
terms: the best running score is divided by the current length). These are the rules of
Hugging Face's ``generate(num_beams=k, do_sample=False)``; the tests check the same
hypotheses, in the same order, with the same scores.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from course_pkg.sampling_params import BeamSearchParams, SamplingParams
from course_pkg.sequence import Sequence
from course_pkg.undo import transaction


@dataclass
class BeamSearchSequence:
    """One hypothesis (vLLM's name): ``tokens`` are the prompt plus the generated tokens."""

    tokens: list[int]
    cum_logprob: float
    text: str | None = None
    finish_reason: str = "length"
    score: float = 0.0   # cum_logprob / generated_length ** length_penalty (the ranking)


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best hypotheses of one prompt, best first (vLLM's name)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass(frozen=True)
class BeamStep:
    """What one step of the search did, for the chapter's trace (seq ids of the beams)."""

    step: int
    kept: tuple[tuple[int, int, int], ...]      # (new beam seq id, from beam seq id, token)
    pruned: tuple[int, ...]                     # beams released
    finished: tuple[tuple[int, int], ...]       # (from beam seq id, token) that ended
    copies: tuple[tuple[int, int], ...]         # copy-on-write (src, dst) blocks


def beam_search_one(engine, prompt_token_ids: list[int], params: BeamSearchParams,
                    on_step=None, cache_salt: str | None = None) -> BeamSearchOutput:
    """Run beam search for one prompt on ``engine``'s model, block manager and KV cache.

    ``cache_salt`` (chapter 12) keys the prompt's blocks; every beam, a fork, inherits it.
    ``on_step(BeamStep, beams)`` is called after each step with the live beams (for the
    chapter's drawings). Every block is released before returning, also on an exception: the
    live beams are listed, inside each step's transaction, in ``engine.live_beams``, which the
    engine releases at the end and after any fault (``LLMEngine._finish_interrupted_step``), a
    fault on a line of the release itself included.
    """
    bm, runner = engine.block_manager, engine.model_runner
    live = engine.live_beams
    eos = frozenset() if params.ignore_eos else engine.scheduler.eos_token_ids
    sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
    root = Sequence(prompt_token_ids, sampling, block_size=engine.block_size, cache_salt=cache_salt)
    with transaction(bm, root):
        bm.allocate(root, bm.can_allocate(root))
        live[:] = [root]
    root.num_scheduled_tokens = root.num_tokens - root.num_cached_tokens
    beams, scores = [root], [0.0]
    finished: list[BeamSearchSequence] = []
    try:
        for step in range(1, params.max_tokens + 1):
            # Each step is a transaction (course_pkg.undo): if it raises, the beams of the step
            # before hold their blocks again, and ``finally`` frees them.
            with _search_transaction(engine, beams):
                logprobs = runner.compute_logprobs(beams)                       # [beams, vocab]
                for beam in beams:
                    beam.num_cached_tokens += beam.num_scheduled_tokens
                    beam.num_scheduled_tokens = 0
                    bm.hash_blocks(beam)
                finished_now, running, ended, stop = _search_step(params, step, eos, logprobs, scores,
                                                                  beams, finished)
                if not stop:
                    next_beams, next_scores, record = _next_beams(bm, runner, beams, running)
                    live[:] = next_beams
            finished = finished_now
            if stop:
                break
            beams, scores = next_beams, next_scores
            if on_step is not None:
                on_step(BeamStep(step=step, kept=record["kept"], pruned=record["pruned"],
                                 finished=tuple(ended), copies=record["copies"]), beams)
    finally:   # (undoes a step a fault left open, then releases every beam)
        engine._finish_interrupted_step()
    if engine.tokenizer is not None:
        n = len(prompt_token_ids)
        for h in finished:
            h.text = engine.tokenizer.decode(h.tokens[n:], skip_special_tokens=True)
    return BeamSearchOutput(sequences=finished)


@contextmanager
def _search_transaction(engine, beams: list[Sequence]):
    """One step of the search as a transaction over the block manager and the beams; if it
    raises, the blocks the step's K/V writes overwrote also lose their cache entries."""
    runner = engine.model_runner
    runner.begin_step(beams)
    try:
        with transaction(engine.block_manager, *beams):
            yield
        runner.end_step()
    except BaseException:
        engine.block_manager.forget_overwritten(runner.written_slots())   # (a beam only writes past its own K/V)
        runner.abort_step()
        raise


def _search_step(params: BeamSearchParams, step: int, eos, logprobs: torch.Tensor, scores: list[float],
                 beams: list[Sequence], finished: list[BeamSearchSequence]):
    """Rank this step's candidates (steps 2 and 3 of the module docstring).

    Returns ``(finished, running, ended, stop)``: the best ``beam_width`` finished hypotheses
    so far, the candidates that go on, the ``(beam seq id, token)`` pairs that ended a
    hypothesis now, and whether the search stops after this step.
    """
    k, lp = params.beam_width, params.length_penalty
    total = logprobs + torch.tensor(scores, dtype=logprobs.dtype).unsqueeze(1)
    top_scores, top_index = torch.topk(total.flatten(), k=min(2 * k, total.numel()))
    vocab = logprobs.shape[1]
    candidates = [(score, i // vocab, i % vocab) for score, i in zip(top_scores.tolist(), top_index.tolist())]
    last = step == params.max_tokens
    ends = [last or token in eos for _, _, token in candidates]
    ended = []
    finished = list(finished)
    for rank, ((score, b, token), end) in enumerate(zip(candidates, ends)):
        if end and rank < k:   # only the first k candidates may end a hypothesis
            ended.append((beams[b].seq_id, token))
            finished.append(BeamSearchSequence(
                tokens=beams[b].token_ids + [token], cum_logprob=score,
                finish_reason="stop" if token in eos else "length", score=score / step ** lp))
    finished = sorted(finished, key=lambda h: -h.score)[:k]
    running = [c for c, end in zip(candidates, ends) if not end][:k]
    # Stop at the last token, or when no running beam can beat the worst finished hypothesis.
    stop = last or not running or (len(finished) == k and running[0][0] / step ** lp <= finished[-1].score)
    return finished, running, ended, stop


def _next_beams(bm, runner, beams: list[Sequence], running):
    """Turn the chosen (score, beam, token) candidates into the next beams, with forks."""
    uses: dict[int, list[tuple[float, int]]] = {}
    for score, b, token in running:
        uses.setdefault(b, []).append((score, token))
    new_beams, new_scores, kept = [], [], []
    # Fork first (a fork copies the parent's tokens), then append, then release the pruned:
    # releasing last keeps a shared block alive while a fork still needs it.
    for b, choices in uses.items():
        parent = beams[b]
        children = [parent.fork(parent.index) for _ in choices[1:]]
        for child in children:
            bm.fork(parent, child)
        for seq, (score, token) in zip([parent] + children, choices):
            seq.append_token(token)
            new_beams.append(seq)
            new_scores.append(score)
            kept.append((seq.seq_id, parent.seq_id, token))
    pruned = [beam for i, beam in enumerate(beams) if i not in uses]
    for beam in pruned:
        bm.deallocate(beam)
    # Order the beams by score, as the candidates were, and give each a place for its token.
    order = sorted(range(len(new_beams)), key=lambda i: -new_scores[i])
    new_beams = [new_beams[i] for i in order]
    new_scores = [new_scores[i] for i in order]
    copies = []
    for beam in new_beams:
        copies += bm.may_append(beam)
        beam.num_scheduled_tokens = 1
    runner.copy_blocks(copies)
    return new_beams, new_scores, {"kept": tuple(kept), "pruned": tuple(b.seq_id for b in pruned),
                                   "copies": tuple(copies)}
