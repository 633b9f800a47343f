"""Synthetic request mixes and a model-free serving simulator (chapters 03-04 experiments).

The experiments measure the *bookkeeping*: which blocks a request gets, what the prefix
cache finds, what eviction costs. For that no model is needed. A ``Request`` carries its
prompt and the tokens the "model" will decode (fixed in advance by the workload, so a
multi-turn chat can put a previous answer into its next prompt), and the ``Simulator``
drives ``Sequence`` + ``BlockManager`` through prefill and decode steps the way a
continuous-batching scheduler does (Nano-vLLM's policy): admit waiting requests first-come
first-served while blocks and the token budget allow; otherwise run one decode step for
every running sequence, preempting the newest one when a block is missing. After each step
the computed tokens are counted in ``num_cached_tokens`` and ``hash_blocks`` registers the
blocks that became full -- as the scheduler does after the model runs.

Workloads (all seeded):

* ``shared_prefix_workload`` -- requests that start with one of a few long system prompts
  (popular ones more often) and end with a distinct question;
* ``multi_turn_workload``    -- chats whose next prompt holds the previous turns and answers;
* ``random_workload``        -- independent requests of random lengths, nothing shared.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from course_pkg.block_manager import BlockManager
from course_pkg.sampling_params import SamplingParams
from course_pkg.sequence import Sequence, SequenceStatus

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


class ForwardReleaseBlockManager(BlockManager):
    """A BlockManager whose ``deallocate`` releases blocks first to last (chapter 03's foil).

    Everything else is the real BlockManager. The parent walks the block table backwards,
    so handing it the table reversed makes the walk go forwards: the prefix reaches the
    free queue first and is overwritten first.
    """

    def deallocate(self, seq: Sequence) -> None:
        seq.block_table.reverse()  # empty table: a no-op, and the parent raises as usual
        super().deallocate(seq)


class UnguardedBlockManager(BlockManager):
    """A BlockManager without the stale-entry guard (chapter 04's foil -- never use it).

    When it hands out a free block for new content it leaves the block's old index entry
    in place. The token check on a hit does not save it: the block may later hold the
    same tokens after another prefix, and then the stale entry yields a wrong hit.
    """

    def _allocate_block(self):
        block = self.blocks[self.free_block_ids.popleft()]
        block.reset()  # no `del self.hash_to_block_id[block.hash]` first
        self.used_block_ids.add(block.block_id)
        return block


def make_block_manager(num_blocks: int, block_size: int, *, release: str = "reversed",
                       **kwargs) -> BlockManager:
    """A BlockManager that releases in ``release`` order: "reversed" (the real one) or "forward"."""
    if release == "reversed":
        return BlockManager(num_blocks, block_size, **kwargs)
    if release == "forward":
        return ForwardReleaseBlockManager(num_blocks, block_size, **kwargs)
    raise ValueError(f"release must be 'reversed' or 'forward', got {release!r}")


@dataclass(frozen=True)
class SimResult:
    """What a simulation measured. Token counts are vLLM's: queries and hits in tokens."""

    num_requests: int
    num_steps: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_computed_tokens: int        # prompt tokens the prefill steps had to compute
    mean_kv_cache_usage: float      # averaged over steps
    max_kv_cache_usage: float


class Simulator:
    """Continuous batching without a model: drives ``Sequence`` + ``BlockManager`` step by step.

    Each ``step()`` is a prefill step (admit waiting requests in order while the head fits:
    blocks via ``can_allocate``, at most ``max_num_seqs`` running, at most
    ``max_num_batched_tokens`` new tokens) or, when nothing can be admitted, a decode step
    (one token for every running sequence; when ``can_append`` fails, the newest running
    sequence is preempted: its blocks are released and it waits at the front of the queue,
    to be prefilled again). The model's work is faked: a prefill computes every uncached
    token and "samples" the request's next output token; a decode computes the newest token.
    """

    def __init__(self, requests: list[Request], block_manager: BlockManager, *,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 4096):
        bm = block_manager
        for i, r in enumerate(requests):
            need = (r.num_tokens + bm.block_size - 1) // bm.block_size
            if need > bm.num_blocks:
                raise ValueError(f"request {i} needs up to {need} blocks, the pool has {bm.num_blocks}")
            if r.parent is not None and not 0 <= r.parent < i:
                raise ValueError(f"request {i}: parent {r.parent} must be an earlier request")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.requests = requests
        self.block_manager = bm
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.seqs = [Sequence(list(r.prompt_token_ids), block_size=bm.block_size) for r in requests]
        self.index = {seq.seq_id: i for i, seq in enumerate(self.seqs)}
        self.waiting: deque[Sequence] = deque(self.seqs)
        self.running: list[Sequence] = []
        self.finished = [False] * len(requests)
        # Step numbers (0-based) of each request's first admission and of its finish.
        self.admitted_at: list[int | None] = [None] * len(requests)
        self.finished_at: list[int | None] = [None] * len(requests)
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_computed_tokens = 0
        self._usage_sum = 0.0
        self._usage_max = 0.0

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _sample(self, seq: Sequence) -> None:
        """The fake model's output: the request's next token; finish when all are out."""
        request = self.requests[self.index[seq.seq_id]]
        seq.append_token(request.output_token_ids[seq.num_completion_tokens])
        if seq.num_completion_tokens == len(request.output_token_ids):
            seq.status = SequenceStatus.FINISHED
            self.block_manager.deallocate(seq)
            self.running.remove(seq)
            self.finished[self.index[seq.seq_id]] = True
            self.finished_at[self.index[seq.seq_id]] = self.num_steps

    def _computed(self, seq: Sequence) -> None:
        """After the model ran: every token so far has K/V; register newly full blocks."""
        full_before = seq.num_cached_tokens // seq.block_size
        seq.num_cached_tokens = seq.num_tokens
        if seq.num_tokens // seq.block_size > full_before:  # a block became full
            self.block_manager.hash_blocks(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def step(self) -> str:
        """Run one step; return "prefill", "decode" or "idle" (nothing left to do)."""
        bm = self.block_manager
        scheduled: list[Sequence] = []
        num_batched = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            parent = self.requests[self.index[seq.seq_id]].parent
            if parent is not None and not self.finished[parent]:
                break  # the previous turn of this chat is still running
            cached = bm.can_allocate(seq)
            if cached == -1:
                break
            new_tokens = seq.num_tokens - cached * bm.block_size
            if scheduled and num_batched + new_tokens > self.max_num_batched_tokens:
                break
            bm.allocate(seq, cached)
            num_batched += new_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
            if self.admitted_at[self.index[seq.seq_id]] is None:
                self.admitted_at[self.index[seq.seq_id]] = self.num_steps
        if scheduled:
            kind = "prefill"
            self.num_computed_tokens += num_batched
        elif self.running:
            kind = "decode"
            for seq in list(self.running):
                if seq not in self.running:  # preempted earlier in this loop
                    continue
                while not bm.can_append(seq):
                    self._preempt(self.running[-1])
                    if seq not in self.running:
                        break
                else:
                    bm.may_append(seq)
                    scheduled.append(seq)
        elif self.waiting:
            raise RuntimeError("nothing runs and the first waiting request cannot be admitted")
        else:
            return "idle"
        usage = bm.kv_cache_usage
        self._usage_sum += usage
        self._usage_max = max(self._usage_max, usage)
        for seq in scheduled:
            self._computed(seq)
            self._sample(seq)
        self.num_steps += 1
        return kind

    def run(self) -> SimResult:
        while not self.done:
            self.step()
        return self.result()

    def result(self) -> SimResult:
        stats = self.block_manager.prefix_cache_stats
        return SimResult(
            num_requests=len(self.requests), num_steps=self.num_steps,
            num_preemptions=self.num_preemptions, prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits, prefix_cache_hit_rate=stats.hit_rate,
            num_computed_tokens=self.num_computed_tokens,
            mean_kv_cache_usage=self._usage_sum / self.num_steps if self.num_steps else 0.0,
            max_kv_cache_usage=self._usage_max)


def serve_with_scheduler(requests: list[Request], scheduler) -> list[Sequence]:
    """Serve ``requests`` with the engine's real ``Scheduler`` (chapter 06) and fake decoded tokens.

    The same job as ``Simulator``, done by the production scheduler instead (which also
    chunks long prompts). A request is handed to the scheduler once its parent has finished,
    in workload order. Returns the sequences, finished, in workload order; the statistics are
    in ``scheduler.block_manager.prefix_cache_stats`` and ``scheduler.stats``.
    """
    seqs = [Sequence(list(r.prompt_token_ids),
                     SamplingParams(max_tokens=len(r.output_token_ids), ignore_eos=True),
                     block_size=scheduler.block_size) for r in requests]
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    finished = [False] * len(requests)
    next_request = 0
    while True:
        while next_request < len(requests) and (requests[next_request].parent is None
                                                or finished[requests[next_request].parent]):
            scheduler.add(seqs[next_request])
            next_request += 1
        if scheduler.is_finished():
            break
        batch, _ = scheduler.schedule()
        if not batch:
            raise RuntimeError("the scheduler scheduled nothing although requests are waiting")
        tokens = []
        for seq in batch:  # a chunk that does not finish the prompt samples nothing
            done_after = seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens
            outputs = requests[index[seq.seq_id]].output_token_ids
            tokens.append(outputs[seq.num_completion_tokens] if done_after else None)
        for seq in scheduler.postprocess(batch, tokens):
            finished[index[seq.seq_id]] = True
    return seqs


def simulate(requests: list[Request], num_blocks: int, block_size: int = 16, *,
             release: str = "reversed", free_queue: str = "deque", enable_prefix_caching: bool = True,
             max_num_seqs: int = 32, max_num_batched_tokens: int = 4096) -> SimResult:
    """Serve ``requests`` on a pool of ``num_blocks`` blocks and return what was measured."""
    bm = make_block_manager(num_blocks, block_size, release=release, free_queue=free_queue,
                            enable_prefix_caching=enable_prefix_caching)
    return Simulator(requests, bm, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens).run()
