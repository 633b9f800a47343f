"""How one request is decoded: temperature, top-p, length, seed."""
from __future__ import annotations

from dataclasses import dataclass

from course_pkg.validation import SEED_LIMIT, check_bool, check_int, check_positive_int, check_real


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, named as vLLM names them.

    ``temperature == 0`` means greedy decoding. ``ignore_eos`` keeps generating past the
    end-of-sequence token until ``max_tokens`` (benchmarks use it for fixed lengths). ``seed``
    gives the request a random generator of its own, so its tokens do not depend on the other
    requests in its batches: an integer in ``[0, 2**32 - n]`` (torch's generator keeps 32 bits
    of a seed, so a larger one would draw the same numbers as a smaller one).
    ``n`` completions are sampled from one prompt (parallel sampling): the prompt is computed
    once and shared; completion ``j`` draws from a generator seeded ``seed + j``, so it equals
    the one-completion request with seed ``seed + j``.

    Every field is checked when the object is made, strictly by type: ``ignore_eos="no"`` or
    ``seed=1.0`` is refused rather than misread.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1

    def __post_init__(self):
        check_real("temperature", self.temperature, minimum=0.0)
        check_real("top_p", self.top_p, minimum=0.0, maximum=1.0, min_inclusive=False)
        check_positive_int("max_tokens", self.max_tokens)
        check_bool("ignore_eos", self.ignore_eos)
        check_positive_int("n", self.n)
        if self.seed is not None:
            check_int("seed", self.seed)
            if not 0 <= self.seed <= SEED_LIMIT - self.n:
                same = f"seed {self.seed % SEED_LIMIT}" if self.n == 1 else "another seed"
                raise ValueError(f"seed must be an integer in [0, 2**32 - n] = [0, {SEED_LIMIT - self.n}], got "
                                 f"{self.seed}: torch's generator keeps 32 bits of a seed, so it would draw the "
                                 f"same numbers as {same}" + (" (completion j draws with seed + j)" if self.n > 1 else ""))


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search settings, named as vLLM's ``BeamSearchParams``.

    ``beam_width`` hypotheses are kept per step; ``length_penalty`` divides a finished
    hypothesis's log-probability by its generated length to this power when ranking them
    (Hugging Face's rule); ``temperature`` must be 0 (deterministic beam search).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        check_positive_int("beam_width", self.beam_width)
        check_positive_int("max_tokens", self.max_tokens)
        check_bool("ignore_eos", self.ignore_eos)
        if check_real("temperature", self.temperature, minimum=0.0) != 0.0:
            raise ValueError(f"beam search here is deterministic: temperature must be 0, got {self.temperature!r}")
        # |length_penalty| <= 10 keeps generated_length ** length_penalty a finite float for
        # any length (4096 ** 10 is about 1e36): beyond it the ranking overflows.
        check_real("length_penalty", self.length_penalty, minimum=-10.0, maximum=10.0)
