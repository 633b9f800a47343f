"""A request, as the scheduler and the block manager see it: tokens and a block table (ch. 01-02).

The sequence splits its tokens into *logical* blocks of ``block_size`` tokens: logical
block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``. ``block_table[i]`` is
the *physical* block (an index into the BlockManager's pool) that stores logical block i.
(A hybrid model of chapter 16 has a table per KV cache group: ``block_table`` is the first
group's, ``group_block_tables`` the others'.)
"""
from __future__ import annotations

from enum import Enum, auto

from course_pkg.sampling_params import SamplingParams
from course_pkg.validation import check_cache_salt, check_positive_int, check_token_ids


_DEFAULT_SAMPLING_PARAMS = SamplingParams()


class SequenceStatus(Enum):
    """Where a request is in its life, named as vLLM's ``RequestStatus`` names it.

    * ``WAITING``: new, holding no blocks;
    * ``RUNNING``: admitted, holding blocks -- decoding, or (still in the waiting queue)
      a prompt that the last step computed only a chunk of;
    * ``PREEMPTED``: gave its blocks back, to be recomputed on readmission;
    * ``SWAPPED``: gave its device blocks back, its K/V wait in the CPU pool (vLLM v0);
    * ``FINISHED_*``: done, for the reason named.

    The Scheduler sets every status, through ``check_transition``, and it alone decides why a
    request finished: the end-of-sequence token (``FINISHED_STOPPED``), its length limit
    (``FINISHED_LENGTH_CAPPED``: ``max_tokens`` or ``max_model_len``), or an abort
    (``FINISHED_ABORTED``).
    """

    WAITING = auto()
    RUNNING = auto()
    PREEMPTED = auto()
    SWAPPED = auto()
    FINISHED_STOPPED = auto()
    FINISHED_LENGTH_CAPPED = auto()
    FINISHED_ABORTED = auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """vLLM's ``finish_reason``: "stop", "length", "abort", or None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
                   SequenceStatus.FINISHED_ABORTED: "abort"}

RequestStatus = SequenceStatus   # vLLM's name

_S = SequenceStatus
#: The life of a request: every status change the Scheduler may make.
TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
    _S.SWAPPED: frozenset({_S.RUNNING, _S.FINISHED_ABORTED}),
    _S.RUNNING: frozenset({_S.PREEMPTED, _S.SWAPPED, _S.FINISHED_STOPPED, _S.FINISHED_LENGTH_CAPPED,
                           _S.FINISHED_ABORTED}),
    _S.FINISHED_STOPPED: frozenset(),
    _S.FINISHED_LENGTH_CAPPED: frozenset(),
    _S.FINISHED_ABORTED: frozenset(),
}


def check_transition(seq: "Sequence", status: SequenceStatus) -> None:
    """Raise ``RuntimeError`` unless ``seq`` may go from its status to ``status``."""
    if status not in TRANSITIONS[seq.status]:
        raise RuntimeError(f"sequence {seq.seq_id} cannot go from {seq.status.name} to {status.name}")


class Sequence:
    """Token ids plus the bookkeeping the block manager and scheduler keep per request.

    ``num_cached_tokens`` counts the leading tokens whose K/V are in the cache now:
    prefix-cache hits plus the tokens computed by earlier steps (it grows every step, and a
    preemption sets it back to 0). Not to be confused with ``RequestOutput.num_cached_tokens``,
    which is, as in vLLM, the prefix-cache hit at admission only. ``num_scheduled_tokens`` is
    how many tokens the current step computes. Each sequence knows its own ``block_size``.
    """

    _ids: "SequenceIds"   # (set below the class) ids in order, each once

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams | None = None,
                 *, block_size: int, cache_salt: str | None = None):
        check_positive_int("block_size", block_size)
        cache_salt = check_cache_salt(cache_salt)
        token_ids = check_token_ids("token_ids", token_ids)
        if not token_ids:
            raise ValueError("a sequence needs at least one token (the prompt is empty)")
        if sampling_params is None:
            sampling_params = _DEFAULT_SAMPLING_PARAMS   # frozen: one instance serves every sequence
        elif not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        self.seq_id = Sequence._ids.take()
        self.status = SequenceStatus.WAITING
        self.block_size = block_size
        self.token_ids = token_ids
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_preemptions = 0
        self.submitted = False  # handed to a Scheduler: a request is submitted once
        self.block_table: list[int] = []
        # A hybrid model's other KV cache groups (chapter 16): one table per group after the
        # first, -1 where a block left a sliding window. Empty while the model is all full attention.
        self.group_block_tables: list[list[int]] = []
        # Chained hashes of the leading full blocks whose K/V are computed and registered.
        self.block_hashes: list[int] = []
        # Mixed into the hash of the first block (chapter 12): only requests with the same
        # salt (or none) can share cached blocks. Forks inherit it.
        self.cache_salt = cache_salt
        self.sampling_params = sampling_params
        self.temperature = sampling_params.temperature
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        # Parallel sampling (chapter 08): completion ``index`` of request ``request_id``; the
        # first completion is the request's own sequence, the others are forks of it.
        self.request_id = self.seq_id
        self.index = 0
        self.parent: Sequence | None = None
        self.children: list[Sequence] = []   # the forks of a parent, completions 1 .. n-1
        self.cumulative_logprob = 0.0        # sum of the log-probabilities of its sampled tokens

    def fork(self, index: int) -> "Sequence":
        """A new sequence with this one's tokens and progress, as completion ``index`` of the
        same request. Blocks are not copied here: ``BlockManager.fork`` shares them."""
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = Sequence._ids.take()
        child.token_ids = list(self.token_ids)
        child.block_table = []
        child.group_block_tables = []
        child.block_hashes = []
        child.children = []
        child.index = index
        child.parent = self if self.parent is None else self.parent
        return child

    @property
    def num_samples(self) -> int:
        """Tokens to sample for this sequence in its next sampled step: ``n`` when it is a
        request's first sequence about to sample its first token (it forks into ``n``
        completions then), else 1."""
        n = self.sampling_params.n
        if n > 1 and self.parent is None and not self.children and self.num_completion_tokens == 0:
            return n
        return 1

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

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
        if i < 0 or i * self.block_size >= self.num_tokens:   # i.e. not 0 <= i < num_blocks
            raise IndexError(f"logical block {i} out of range: sequence has {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        if type(token_id) is not int or token_id < 0:   # (is_int, inlined: called once per token)
            raise ValueError(f"sequence {self.seq_id}: cannot append {token_id!r}, a token id is an integer >= 0")
        self.token_ids.append(token_id)
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, block_table={self.block_table})")


class SequenceIds:
    """The ids of new sequences: 0, 1, 2, ... in order, each once."""

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> int:
        seq_id, self.next = self.next, self.next + 1
        return seq_id


Sequence._ids = SequenceIds()
