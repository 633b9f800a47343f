"""Serving a workload with the real Scheduler and a fake model (chapters 03, 04, 07).

The experiments measure the *bookkeeping*: which blocks a request gets, what the prefix
cache finds, what eviction costs. For that no model is needed. ``WorkloadRun`` hands the
requests to the package's own ``Scheduler`` (chapter 06) -- admission, chunked prefill and
preemption are its decisions -- and answers each step with the request's next output token;
``simulate`` does that on a fresh pool and returns what was measured. The foils of
:mod:`course_pkg.foils` plug into the same Scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass

from course_pkg.block_manager import BlockManager
from course_pkg.foils import make_block_manager
from course_pkg.sampling_params import SamplingParams
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import Sequence
from course_pkg.workloads.requests import Request


@dataclass(frozen=True)
class SimResult:
    """What a run measured. Token counts are vLLM v1's: queries and hits in tokens, at first
    admission only (a preempted request's re-lookup is counted apart, in the BlockManager's
    ``prefix_cache_stats.preempted_*``); its recomputation counts as computed tokens."""

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

    def _fake_model(self, out) -> list[list[int]]:
        """What the model would sample for each sequence of the step ``out``: its recorded answer."""
        tokens = []
        for seq, num_samples in zip(out.seqs, out.num_samples):
            answer = self.requests[self.index[seq.seq_id]].output_token_ids
            tokens.append([answer[seq.num_completion_tokens]] * num_samples)
        return tokens

    def step(self) -> str:
        """Run one step; return "prefill", "decode" or "idle" (nothing left to do)."""
        self._hand_in()
        if self.scheduler.is_finished():
            return "idle"
        out = self.scheduler.schedule()   # never empty while work remains
        usage = self.block_manager.kv_cache_usage
        self._usage_sum += usage
        self._usage_max = max(self._usage_max, usage)
        for seq in out.seqs:
            i = self.index[seq.seq_id]
            if self.admitted_at[i] is None:
                self.admitted_at[i] = self.num_steps
        for seq in self.scheduler.update_from_output(out, self._fake_model(out)):
            i = self.index[seq.seq_id]
            self.finished[i] = True
            self.finished_at[i] = self.num_steps
        self.num_steps += 1
        return "prefill" if out.is_prefill else "decode"

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
                          max_num_batched_tokens=max_num_batched_tokens, transactional=False)   # no model: no fault to undo
    return WorkloadRun(requests, scheduler).run()
