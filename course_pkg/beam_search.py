"""Beam search's rule (chapter 08): which candidates a step keeps, which end a hypothesis, when it stops.

A beam search is one request whose beams are forked sequences: they share their blocks, the
partly filled last one too. It runs through the ordinary step loop. ``schedule`` gives every
live beam its decode token and asks the model runner for each beam's ``2 * beam_width`` most
likely next tokens (``SchedulerOutput.num_logprobs``); ``update_from_output`` hands them to
``BeamSearch.rank`` and rebuilds the beams from the verdict (``Scheduler._step_beams``). Every
step:

1. every (beam, token) pair is a candidate scored ``beam score + log p(token)``; the best
   ``2 * beam_width`` are kept, best first (a beam's own ``2 * beam_width`` best tokens are
   enough to find them);
2. a candidate that ends a hypothesis (the end-of-sequence token, or the last allowed token)
   and ranks among the first ``beam_width`` becomes a *finished hypothesis*, ranked by
   ``score / generated_length ** length_penalty``; the best ``beam_width`` candidates that do
   not end go on as the next beams;
3. the next beams are made from the old ones on the block manager: a beam chosen once keeps
   its sequence, a beam chosen ``m`` times is forked ``m - 1`` times, a beam not chosen is
   dropped (it finishes as aborted and releases its blocks). Appending the new token to a
   shared partial block is a copy-on-write, made by the next ``schedule``.

Search stops when the last token is reached, or when no running beam can still beat the
worst of ``beam_width`` finished hypotheses (``early_stopping=False`` in Hugging Face's
terms: the best running score is divided by the current length); every beam left is dropped.
These are the rules of Hugging Face's ``generate(num_beams=k, do_sample=False)``; the tests
check the same hypotheses, in the same order, with the same scores. The sums are float32
additions, as Hugging Face's tensors make them.

The beams of one search step together (they are ranked together), so a search runs alone in
its scheduler: nothing else can be admitted beside it, and no beam is ever preempted.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from course_pkg.sampling_params import BeamSearchParams
from course_pkg.sequence import Sequence


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
    pruned: tuple[int, ...]                     # beams dropped
    finished: tuple[tuple[int, int], ...]       # (from beam seq id, token) that ended a hypothesis
    copies: tuple[tuple[int, int], ...]         # copy-on-write (src, dst) made before this step's forward pass


@dataclass(frozen=True)
class BeamRanking:
    """``BeamSearch.rank``'s verdict on one step."""

    finished: list[BeamSearchSequence]          # the best beam_width finished hypotheses so far
    running: list[tuple[float, int, int]]       # (score, beam index, token) that go on, best first
    ended: list[tuple[int, int]]                # (beam seq id, token) that ended a hypothesis now
    stop: bool                                  # the search ends with this step


class BeamSearch:
    """One request's beam search: its live beams (best first) with their scores, and the
    finished hypotheses. The Scheduler holds it (``Scheduler.beam_searches``) and changes it
    inside the step's transaction; ``steps`` is the trace, one ``BeamStep`` per step."""

    def __init__(self, root: Sequence, params: BeamSearchParams, eos_token_ids: frozenset[int]):
        self.request_id = root.request_id
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.beams: list[Sequence] = [root]
        self.scores: list[float] = [0.0]
        self.finished: list[BeamSearchSequence] = []
        self.steps: list[BeamStep] = []

    @property
    def num_logprobs(self) -> int:
        """Next tokens asked of the runner per beam: enough for the best ``2 * beam_width`` overall."""
        return 2 * self.params.beam_width

    def rank(self, candidates: list[list[tuple[int, float]]]) -> BeamRanking:
        """Rank this step's candidates (steps 1 and 2 of the module docstring): ``candidates[b]``
        are the ``(token, log-probability)`` pairs of beam ``b``'s most likely next tokens.
        Changes nothing."""
        k, lp, beams = self.params.beam_width, self.params.length_penalty, self.beams
        step = beams[0].num_completion_tokens + 1   # the length of the hypotheses this step makes
        scored = [(_float32(self.scores[b] + logprob), b, token)
                  for b, row in enumerate(candidates) for token, logprob in row]
        scored.sort(key=lambda c: -c[0])             # (stable: ties keep the beams' order)
        scored = scored[:2 * k]
        last = step == self.params.max_tokens
        ends = [last or token in self.eos_token_ids for _, _, token in scored]
        ended, finished = [], list(self.finished)
        for rank, ((score, b, token), end) in enumerate(zip(scored, ends)):
            if end and rank < k:   # only the first k candidates may end a hypothesis
                ended.append((beams[b].seq_id, token))
                finished.append(BeamSearchSequence(
                    tokens=beams[b].token_ids + [token], cum_logprob=score,
                    finish_reason="stop" if token in self.eos_token_ids else "length", score=score / step ** lp))
        finished = sorted(finished, key=lambda h: -h.score)[:k]
        running = [c for c, end in zip(scored, ends) if not end][:k]
        # Stop at the last token, or when no running beam can beat the worst finished hypothesis.
        stop = last or not running or (len(finished) == k and running[0][0] / step ** lp <= finished[-1].score)
        return BeamRanking(finished, running, ended, stop)


def _float32(x: float) -> float:
    """``x`` rounded to float32: a sum of two float32 values computed in float64 and rounded is
    exactly their float32 sum, as Hugging Face's (and the runner's) tensors compute it."""
    return struct.unpack("f", struct.pack("f", x))[0]
