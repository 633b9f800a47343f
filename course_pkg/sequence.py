"""A request as the engine sees it: its tokens and its block table (chapters 01-02).

The sequence splits its tokens into *logical* blocks of ``block_size`` tokens: logical
block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``. ``block_table[i]`` is
the *physical* block (an index into the BlockManager's pool) that stores logical block i.
"""
from __future__ import annotations

from enum import Enum, auto
from itertools import count

from course_pkg.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids plus the bookkeeping the block manager and scheduler keep per request.

    ``num_cached_tokens`` counts the leading tokens whose K/V are already in the cache
    (prefix-cache hits plus tokens computed by earlier steps); ``num_scheduled_tokens`` is
    how many tokens the current step computes. Each sequence knows its own ``block_size``.
    """

    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 block_size: int = 16):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("a sequence needs at least one token (the prompt is empty)")
        sampling_params = sampling_params or SamplingParams()
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.block_size = block_size
        self.token_ids = token_ids
        self.last_token = token_ids[-1]
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_preemptions = 0  # times the scheduler sent it back to waiting
        self.block_table: list[int] = []
        # Chained hashes of the leading full blocks whose K/V are computed and registered.
        self.block_hashes: list[int] = []
        self.sampling_params = sampling_params
        self.temperature = sampling_params.temperature
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_cached_blocks(self) -> int:
        """Leading blocks whose every token is already in the cache."""
        return self.num_cached_tokens // self.block_size

    @property
    def num_blocks(self) -> int:
        """Logical blocks needed for all tokens: ceil(num_tokens / block_size)."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        """Tokens in the last logical block (1..block_size)."""
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i``."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"logical block {i} out of range: sequence has {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, block_table={self.block_table})")
