"""How one request is decoded: temperature, top-p, length, seed."""
from __future__ import annotations

from dataclasses import dataclass

from course_pkg.validation import INT64_MAX, INT64_MIN, check_bool, check_int, check_positive_int, check_real


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, named as vLLM names them.

    ``temperature == 0`` means greedy decoding. ``ignore_eos`` keeps generating past the
    end-of-sequence token until ``max_tokens`` (benchmarks use it for fixed lengths). ``seed``
    gives the request a random generator of its own (an integer that fits in int64, as torch's
    generators require), so its tokens do not depend on the other requests in its batches.

    Every field is checked when the object is made, strictly by type: ``ignore_eos="no"`` or
    ``seed=1.0`` is refused rather than misread.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        check_real("temperature", self.temperature, minimum=0.0)
        check_real("top_p", self.top_p, minimum=0.0, maximum=1.0, min_inclusive=False)
        check_positive_int("max_tokens", self.max_tokens)
        check_bool("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            check_int("seed", self.seed, minimum=INT64_MIN, maximum=INT64_MAX)
