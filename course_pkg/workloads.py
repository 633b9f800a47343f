"""Synthetic request mixes, served by the real Scheduler with a fake model (chapters 03, 04, 07).

The experiments measure the *bookkeeping*: which blocks a request gets, what the prefix
cache finds, what eviction costs. For that no model is needed. A ``Request`` carries its
prompt and the tokens the "model" will decode (fixed in advance by the workload, so a
multi-turn chat can put a previous answer into its next prompt). ``WorkloadRun`` hands the
requests to the package's own ``Scheduler`` (chapter 06) -- admission, chunked prefill and
preemption are its decisions, not a copy of them -- and answers each step with the request's
next output token; ``simulate`` does that on a fresh pool and returns what was measured.
The BlockManager foils of chapters 03 and 04 plug into the same Scheduler.

Workloads (all seeded):

* ``shared_prefix_workload`` -- requests that start with one of a few long system prompts
  (popular ones more often) and end with a distinct question;
* ``multi_turn_workload``    -- chats whose next prompt holds the previous turns and answers;
* ``random_workload``        -- independent requests of random lengths, nothing shared.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from course_pkg.block_manager import BlockManager
from course_pkg.sampling_params import SamplingParams
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import Sequence

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
    """What a run measured. Token counts are vLLM's: queries and hits in tokens; a preempted
    request is queried again at readmission and its recomputation counts as computed tokens."""

    num_requests: int
    num_steps: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_computed_tokens: int        # tokens the prefill steps computed (not found in the cache)
    mean_kv_cache_usage: float      # averaged over steps
    max_kv_cache_usage: float


class WorkloadRun:
    """Serve a workload with the package's real ``Scheduler`` and a fake model, step by step.

    The policy -- first-come first-served admission, chunked prefill within
    ``max_num_batched_tokens``, preemption of the most recently admitted sequence -- is
    entirely the ``Scheduler``'s (chapter 06); there is no second copy of it here. This class
    only plays the two parts around the scheduler: the *client*, which hands requests in in
    workload order (a chat's next turn once its previous turn has finished), and the *model*,
    whose "sampled" token is the request's next output token (None for a chunk that does not
    finish a prompt). It also measures what the experiments report: the number of steps, the
    KV-cache usage of each step (after the step's blocks are allocated), and the step at which
    each request was first scheduled and finished. Preemptions and the prompt tokens prefill
    computed are the scheduler's own counters (``scheduler.stats``), the prefix-cache queries
    and hits the BlockManager's (``prefix_cache_stats``).

    Give it a fresh scheduler; to measure a foil, build the scheduler over it
    (``Scheduler(n, block_size, block_manager=ForwardReleaseBlockManager(n, block_size))``).
    """

    def __init__(self, requests: list[Request], scheduler: Scheduler):
        if not scheduler.is_finished():
            raise ValueError("the scheduler already holds requests; give WorkloadRun a fresh one")
        for i, r in enumerate(requests):
            if r.parent is not None and not 0 <= r.parent < i:
                raise ValueError(f"request {i}: parent {r.parent} must be an earlier request")
        self.requests = list(requests)
        self.scheduler = scheduler
        # A chat turn decodes exactly its answer: no EOS, max_tokens = the answer's length.
        self.seqs = [Sequence(list(r.prompt_token_ids),
                              SamplingParams(max_tokens=len(r.output_token_ids), ignore_eos=True),
                              block_size=scheduler.block_size) for r in self.requests]
        for i, seq in enumerate(self.seqs):  # refuse, before anything runs, a request that never fits
            try:
                scheduler.check(seq)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        self.index = {seq.seq_id: i for i, seq in enumerate(self.seqs)}
        self.finished = [False] * len(self.requests)
        # Step numbers (0-based) at which each request was first scheduled and finished.
        self.admitted_at: list[int | None] = [None] * len(self.requests)
        self.finished_at: list[int | None] = [None] * len(self.requests)
        self.num_steps = 0
        self._next_request = 0  # requests before this index were handed to the scheduler
        self._usage_sum = 0.0
        self._usage_max = 0.0

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def running(self) -> list[Sequence]:
        """The scheduler's running sequences (prompt done, decoding), oldest admission first."""
        return list(self.scheduler.running)

    @property
    def holding(self) -> list[Sequence]:
        """Every sequence that holds blocks now: the running ones, and a prompt being chunked.

        Only the head of ``waiting`` can hold blocks: the scheduler allocates when it admits
        the head, and a chunked prompt keeps its blocks and its place there until its last
        chunk; a preempted sequence has released its blocks.
        """
        waiting = self.scheduler.waiting
        chunked = [waiting[0]] if waiting and waiting[0].block_table else []
        return list(self.scheduler.running) + chunked

    @property
    def done(self) -> bool:
        return self._next_request == len(self.requests) and self.scheduler.is_finished()

    def _hand_in(self) -> None:
        """Add the next requests in order, stopping at a chat turn whose previous turn still runs."""
        while self._next_request < len(self.requests):
            parent = self.requests[self._next_request].parent
            if parent is not None and not self.finished[parent]:
                break
            self.scheduler.add(self.seqs[self._next_request])
            self._next_request += 1

    def _fake_model(self, batch: list[Sequence]) -> list[int | None]:
        tokens = []
        for seq in batch:
            completes = seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens
            outputs = self.requests[self.index[seq.seq_id]].output_token_ids
            tokens.append(outputs[seq.num_completion_tokens] if completes else None)
        return tokens

    def step(self) -> str:
        """Run one step; return "prefill", "decode" or "idle" (nothing left to do)."""
        self._hand_in()
        if self.scheduler.is_finished():
            return "idle"
        batch, is_prefill = self.scheduler.schedule()
        while not batch:
            # The only running sequence lacked a block and preempted itself: it is back in
            # ``waiting`` with its blocks freed, and the next schedule readmits it.
            if not self.scheduler.preempted:
                raise RuntimeError("the scheduler scheduled nothing although requests are waiting")
            batch, is_prefill = self.scheduler.schedule()
        usage = self.block_manager.kv_cache_usage
        self._usage_sum += usage
        self._usage_max = max(self._usage_max, usage)
        for seq in batch:
            i = self.index[seq.seq_id]
            if self.admitted_at[i] is None:
                self.admitted_at[i] = self.num_steps
        for seq in self.scheduler.postprocess(batch, self._fake_model(batch)):
            i = self.index[seq.seq_id]
            self.finished[i] = True
            self.finished_at[i] = self.num_steps
        self.num_steps += 1
        return "prefill" if is_prefill else "decode"

    def run(self) -> SimResult:
        while not self.done:
            self.step()
        return self.result()

    def result(self) -> SimResult:
        stats = self.block_manager.prefix_cache_stats
        return SimResult(
            num_requests=len(self.requests), num_steps=self.num_steps,
            num_preemptions=self.scheduler.stats.num_preemptions, prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits, prefix_cache_hit_rate=stats.hit_rate,
            num_computed_tokens=self.scheduler.stats.prefill_kv_computed_tokens,
            mean_kv_cache_usage=self._usage_sum / self.num_steps if self.num_steps else 0.0,
            max_kv_cache_usage=self._usage_max)


def simulate(requests: list[Request], num_blocks: int, block_size: int = 16, *,
             release: str = "reversed", free_queue: str = "deque", enable_prefix_caching: bool = True,
             max_num_seqs: int = 32, max_num_batched_tokens: int = 4096) -> SimResult:
    """Serve ``requests`` with the real ``Scheduler`` on a pool of ``num_blocks`` blocks; what was measured.

    ``release`` picks the BlockManager ("reversed": the package's; "forward": chapter 03's foil).
    """
    bm = make_block_manager(num_blocks, block_size, release=release, free_queue=free_queue,
                            enable_prefix_caching=enable_prefix_caching)
    scheduler = Scheduler(num_blocks, block_size, block_manager=bm, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    return WorkloadRun(requests, scheduler).run()
