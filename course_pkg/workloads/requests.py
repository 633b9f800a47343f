"""Synthetic request mixes for the experiments of chapters 03, 04 and 07 (all seeded).

A ``Request`` carries its prompt and the tokens the fake model will decode for it (fixed in
advance by the workload, so a multi-turn chat can put a previous answer into its next prompt).

* ``shared_prefix_workload`` -- requests that start with one of a few long system prompts
  (popular ones more often) and end with a distinct question;
* ``multi_turn_workload``    -- chats whose next prompt holds the previous turns and answers;
* ``random_workload``        -- independent requests of random lengths, nothing shared.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class Request:
    """One request: its prompt and the tokens the fake model decodes for it, in order.

    ``parent`` is the index (in the workload list) of a request that must finish before this
    one is admitted -- the previous turn of the same chat -- or None.
    """

    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    parent: int | None = None
    tag: str = ""

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if not self.output_token_ids:
            raise ValueError("a request must decode at least one token")

    @property
    def num_tokens(self) -> int:
        """Prompt plus output: the most tokens the request holds at once."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, VOCAB_SIZE) for _ in range(n))


def _length(rng: random.Random, spec: int | tuple[int, int]) -> int:
    """A fixed length, or a uniform draw from an inclusive (low, high) range."""
    if isinstance(spec, int):
        return spec
    low, high = spec
    return rng.randint(low, high)


def shared_prefix_workload(num_requests: int, *, num_prefixes: int = 8, prefix_len: int = 256,
                           suffix_len: int | tuple[int, int] = (16, 64),
                           output_len: int | tuple[int, int] = (8, 32),
                           zipf: float = 1.0, seed: int = 0) -> list[Request]:
    """Requests that share long system prompts and differ in their suffix.

    Prompt ``k`` of ``num_prefixes`` is chosen with weight ``1 / (k + 1) ** zipf`` (a few
    popular prompts, a long tail). With ``num_prefixes=1`` every request shares one prompt.
    The suffix and the decoded tokens are random, so they never match anything.
    """
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len) for _ in range(num_prefixes)]
    weights = [1 / (k + 1) ** zipf for k in range(num_prefixes)]
    requests = []
    for _ in range(num_requests):
        k = rng.choices(range(num_prefixes), weights)[0]
        prompt = prefixes[k] + _tokens(rng, _length(rng, suffix_len))
        requests.append(Request(prompt, _tokens(rng, _length(rng, output_len)), tag=f"prefix {k}"))
    return requests


def multi_turn_workload(num_conversations: int, num_turns: int, *, system_len: int = 64,
                        user_len: int | tuple[int, int] = (16, 48),
                        output_len: int | tuple[int, int] = (16, 64),
                        seed: int = 0) -> list[Request]:
    """Chats: turn ``t + 1``'s prompt is turn ``t``'s prompt + its answer + a new user message.

    Conversations are interleaved turn by turn (every chat's first turn, then every chat's
    second turn, ...), so the more chats run at once the longer a finished turn's blocks
    must survive in the free queue to be reused by the next turn.
    """
    rng = random.Random(seed)
    requests: list[Request] = []
    history = [_tokens(rng, system_len) for _ in range(num_conversations)]
    last_index: list[int | None] = [None] * num_conversations
    for turn in range(num_turns):
        for c in range(num_conversations):
            prompt = history[c] + _tokens(rng, _length(rng, user_len))
            answer = _tokens(rng, _length(rng, output_len))
            requests.append(Request(prompt, answer, parent=last_index[c], tag=f"chat {c} turn {turn}"))
            last_index[c] = len(requests) - 1
            history[c] = prompt + answer
    return requests


def random_workload(num_requests: int, *, prompt_len: int | tuple[int, int] = (32, 512),
                    output_len: int | tuple[int, int] = (16, 256), seed: int = 0) -> list[Request]:
    """Independent requests with random tokens and lengths: nothing to share."""
    rng = random.Random(seed)
    return [Request(_tokens(rng, _length(rng, prompt_len)), _tokens(rng, _length(rng, output_len)),
                    tag="random") for _ in range(num_requests)]
