"""The sampler: one next token per sequence from its logits (chapter 06).

* ``temperature == 0`` is greedy: the arg-max, ties to the lowest token id (as ``torch.argmax``
  and Hugging Face's greedy search break them);
* otherwise the logits are divided by the temperature and turned into probabilities;
* ``top_p < 1`` keeps the smallest set of most likely tokens whose probability reaches
  ``top_p`` (the "nucleus") and drops the rest;
* the token is drawn with the *exponential race*: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d.
  per token picks token ``i`` with probability ``p_i / sum(p)`` -- a categorical sample that
  needs neither normalisation nor ``multinomial``, and runs for a whole batch at once.

Randomness is seeded: the engine's generator (``seed``) serves every request, and a request
with ``SamplingParams(seed=...)`` gets a generator of its own, which draws one ``Exp(1)``
vector per token, so its tokens do not depend on which other requests share its batches. With
speculative decoding (chapter 14) that stays true for n-gram drafts, whose verification draws
one vector per token it yields, as here. It is *not* true for the early-exit draft when the
request samples: drafting samples from the same generator, and rejection sampling draws a
uniform per verified draft, so the draws -- hence the tokens, though not their distribution --
depend on how many lookahead slots the request got at each step, which depends on the pool
and the token budget, so on the other requests. Two runs with the same requests are the same.
A step's draws can be taken back: ``get_state(seqs)`` is where the generators those sequences
draw from stand, and ``set_state`` puts them back there (the model runner does it for a step
that is undone, so that the redone step draws the same).

``temperature`` below ``GREEDY_BELOW`` (1e-5, vLLM's sampling epsilon) is served as greedy:
dividing float32 logits by such a temperature overflows, and the arg-max is what it means.
"""
from __future__ import annotations

import weakref

import torch

from course_pkg.sequence import Sequence

#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``).
GREEDY_BELOW = 1e-5


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's nucleus (``top_p``: ``[n]``); rows unnormalised.

    A token is kept when the probability mass of the tokens ranked before it is still below
    ``top_p``, so the most likely token is always kept.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False   # the most likely token stays, however small top_p is (or rounds to in float32)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


class Sampler:
    """Greedy, temperature and top-p sampling for a batch of sequences, seeded."""

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # A request with its own seed keeps one generator per completion for its whole life
        # (preemption included), under the request's first sequence; weak keys let them go
        # when that sequence is dropped.
        self._seq_generators: weakref.WeakKeyDictionary[Sequence, dict[int, torch.Generator]] = \
            weakref.WeakKeyDictionary()

    def _generator(self, seq: Sequence, index: int) -> torch.Generator:
        """The generator of completion ``index`` of ``seq``'s request, seeded ``seed + index``."""
        per_index = self._seq_generators.setdefault(seq.parent or seq, {})
        gen = per_index.get(index)
        if gen is None:
            gen = per_index[index] = torch.Generator(device=self.device).manual_seed(seq.sampling_params.seed + index)
        return gen

    def get_state(self, seqs) -> tuple:
        """Where the generators ``seqs`` draw from stand now: the shared one's state and, per
        seeded request among them, the states of the generators it has (``set_state`` goes back)."""
        own = {}
        for seq in seqs:
            if seq.sampling_params.seed is not None:
                root = seq.parent or seq
                own[root] = {i: g.get_state() for i, g in self._seq_generators.get(root, {}).items()}
        return self.generator.get_state(), own

    def set_state(self, state: tuple) -> None:
        """Put the generators back where ``get_state`` found them; a generator made since is
        dropped (the next draw makes it again from its seed)."""
        shared, own = state
        self.generator.set_state(shared)
        for root, states in own.items():
            per_index = self._seq_generators.get(root, {})
            for index in [i for i in per_index if i not in states]:
                del per_index[index]
            for index, gen_state in states.items():
                per_index[index].set_state(gen_state)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """``logits``: ``[len(seqs), vocab]``; one token id per sequence (each samples one)."""
        return [tokens[0] for tokens in self.sample(logits, seqs, [1] * len(seqs))[0]]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               num_samples: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """``(tokens, logprobs)``: per sequence a list of ``num_samples`` tokens (default
        ``seq.num_samples``) and their log-probabilities under the model (``log_softmax`` of the
        raw logits). Completion ``j`` of a forking sequence draws as completion ``index + j``."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} sequences")
        if num_samples is None:
            num_samples = [seq.num_samples for seq in seqs]
        if not seqs:
            return [], []
        # One target per token to draw: (sequence, completion index, logits row).
        targets = [(seq, seq.index + j, row) for row, (seq, n) in enumerate(zip(seqs, num_samples))
                   for j in range(n)]
        logits = logits.float()
        rows_of = torch.tensor([row for _, _, row in targets], device=logits.device)
        tokens = self._draw(logits[rows_of], targets)
        logprobs = torch.log_softmax(logits, dim=-1)[rows_of, torch.tensor(tokens, device=logits.device)].tolist()
        out_tokens, out_logprobs = [], []
        k = 0
        for n in num_samples:
            out_tokens.append(tokens[k:k + n])
            out_logprobs.append(logprobs[k:k + n])
            k += n
        return out_tokens, out_logprobs

    def probs(self, rows: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """The distribution ``seq`` samples from, per row of float32 logits (``[n, vocab]``): the
        temperature's softmax, cut to the top-p nucleus and renormalised (speculative decoding's
        target and draft distributions, chapter 14)."""
        probs = torch.softmax(rows.float() / seq.temperature, dim=-1)
        top_p = seq.sampling_params.top_p
        if top_p < 1.0:
            probs = top_p_filter(probs, torch.full((rows.shape[0],), top_p, device=rows.device))
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """The generator ``seq`` draws from: its request's own when seeded, else the shared one."""
        if seq.sampling_params.seed is not None:
            return self._generator(seq, seq.index)
        return self.generator

    def _draw(self, rows: torch.Tensor, targets) -> list[int]:
        """One token per target; ``rows[i]`` are the float32 logits of target ``i``."""
        tokens = rows.argmax(dim=-1)
        sampled = [i for i, (seq, _, _) in enumerate(targets) if seq.temperature >= GREEDY_BELOW]
        if sampled:
            idx = torch.tensor(sampled, device=rows.device)
            temperature = torch.tensor([targets[i][0].temperature for i in sampled], device=rows.device)
            probs = torch.softmax(rows[idx] / temperature.unsqueeze(1), dim=-1)
            top_p = [targets[i][0].sampling_params.top_p for i in sampled]
            if any(p < 1.0 for p in top_p):
                probs = top_p_filter(probs, torch.tensor(top_p, device=rows.device))
            noise = torch.empty_like(probs)
            shared = [j for j, i in enumerate(sampled) if targets[i][0].sampling_params.seed is None]
            if shared:
                noise[shared] = torch.empty((len(shared), probs.shape[1]), device=probs.device).exponential_(
                    generator=self.generator)
            for j, i in enumerate(sampled):
                seq, index, _ = targets[i]
                if seq.sampling_params.seed is not None:
                    noise[j].exponential_(generator=self._generator(seq, index))
            # (clamped: a zero draw would turn a filtered 0 / 0 into NaN)
            tokens[idx] = (probs / noise.clamp_min_(1e-30)).argmax(dim=-1)
        return tokens.tolist()
