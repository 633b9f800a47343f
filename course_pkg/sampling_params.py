"""How one request is decoded: temperature, top-p, length."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, named as vLLM names them.

    ``temperature == 0`` means greedy decoding. ``ignore_eos`` keeps generating past the
    end-of-sequence token until ``max_tokens`` (benchmarks use it for fixed lengths).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
