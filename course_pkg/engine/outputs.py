"""What the engine hands out and reports: outputs, metrics, one step's record (chapter 06).

Names as in vLLM: ``RequestOutput`` holds a request's ``CompletionOutput``s, ``RequestMetrics``
its times; ``EngineMetrics`` is a snapshot of the engine's counters; ``ModelRunnerOutput`` is
what the model runner returns for a step. ``StepInfo`` is the course's own: a printable record
of one step, for notebooks and tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class ModelRunnerOutput:
    """A step's results (vLLM v1's name): per scheduled sequence, in batch order, the
    ``num_samples`` tokens sampled for it (empty for a prompt chunk) and their
    log-probabilities (``log_softmax`` of the raw logits).

    A speculative step (chapter 14) also returns ``draft_token_ids``: per sequence the drafts it
    verified (empty for one that did not speculate); its ``sampled_token_ids`` are then the
    accepted drafts followed by one token of the target's.

    A step with beams (chapter 08) also returns ``top_logprobs``: per sequence the
    ``SchedulerOutput.num_logprobs`` most likely next tokens as ``(token id, log-probability)``
    pairs, best first (empty for a sequence that asked for none)."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[float]]
    draft_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step brought one request (vLLM v1's name): per completion index, the tokens the
    step appended (``new_token_ids``) and their log-probabilities (``new_logprobs``, one per
    token, also for the several tokens of a speculative step), the completions that finished in
    it and why (``finish_reasons``), and a copy of the request's metrics. ``finished``: every
    completion has finished and the request was handed out in this step."""

    request_id: int
    new_token_ids: dict[int, list[int]]
    new_logprobs: dict[int, list[float]]
    finish_reasons: dict[int, str]
    num_cached_tokens: int
    metrics: "RequestMetrics"
    finished: bool = False


@dataclass
class RequestMetrics:
    """Times (``time.perf_counter`` seconds) in the life of one request.

    ``arrival_step`` and ``token_steps`` say the same in engine steps (the step that was next
    when the request arrived; the step that sampled each token): deterministic, for notebooks.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    arrival_step: int = 0
    token_steps: list[int] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        """From arrival until first scheduled (vLLM's ``request_queue_time``)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """From arrival until finished."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def record_token(self, now: float, step: int) -> None:
        """A token was sampled for this request at ``now``, in engine step ``step``. (In this
        order, a call cut short at any line leaves fields the next call can work with.)"""
        if self.last_token_time is not None:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_steps.append(step)

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: from arrival to the first generated token (queueing and prefill included)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``): completion ``index`` of ``n``.

    ``cumulative_logprob`` is the sum of the model's log-probabilities (``log_softmax`` of the
    raw logits) of the completion's tokens. ``AsyncLLM`` (chapter 13) also fills ``logprobs``
    (each token's), ``stop_reason`` (the stop string that ended it) and, while the request
    runs, leaves ``finish_reason`` None.
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str | None
    logprobs: list[float] | None = None
    stop_reason: str | None = None


@dataclass
class RequestOutput:
    """What ``generate`` returns per prompt (names as in vLLM's ``RequestOutput``).

    ``outputs`` holds the request's ``n`` completions in index order; ``text``, ``token_ids``
    and ``finish_reason`` are the first one's, so code written for ``n == 1`` reads them
    directly. ``num_cached_tokens`` is how many prompt tokens the prefix cache provided when the
    request was first admitted (not ``Sequence.num_cached_tokens``, which counts every token
    computed so far). A ``finish_reason`` is ``"stop"`` (end-of-sequence token), ``"length"``
    (``max_tokens`` or ``max_model_len`` reached) or ``"abort"`` (``abort_request``), as the
    Scheduler decided it. ``AsyncLLM`` (chapter 13) hands out outputs while a request runs:
    ``finished`` is False until the last one, and ``request_id`` is the caller's string.
    """

    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics
    finished: bool = True

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    def __getitem__(self, key: str):  # Nano-vLLM returns dicts: out["text"], out["token_ids"]
        return getattr(self, key)


@dataclass(frozen=True)
class EngineMetrics:
    """A snapshot of the engine's counters and gauges, named as vLLM names its metrics."""

    num_requests_running: int
    num_requests_waiting: int
    num_kvcache_blocks: int
    kv_cache_usage_perc: float          # blocks held by sequences / all blocks, in [0, 1]
    prefix_cache_queries: int           # tokens looked up at admission
    prefix_cache_hits: int              # of those, tokens found in the cache
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens: int                  # prompt tokens of all requests added
    generation_tokens: int              # tokens sampled
    prefill_kv_computed_tokens: int     # tokens prefill steps computed (cache hits excluded)
    num_prefill_steps: int
    num_decode_steps: int
    num_mixed_steps: int = 0            # scheduling="mixed": steps with decodes and prompt chunks
    num_swapped_out: int = 0            # preemption_mode="swap": victims swapped to the CPU pool
    num_swapped_in: int = 0
    num_swap_fallbacks: int = 0         # swap preemptions recomputed because the CPU pool was full
    cpu_kv_cache_usage_perc: float = 0.0
    # speculative decoding (chapter 14): proposals, their tokens, the tokens accepted (per position)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # the tier behind the device pool (chapter 15): per first admission, tokens asked of it and
    # found in it (vLLM's external prefix cache); blocks and bytes moved, blocks it gave up
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_blocks_stored: int = 0
    kv_offload_blocks_loaded: int = 0
    kv_offload_blocks_evicted: int = 0
    kv_offload_bytes_stored: int = 0
    kv_offload_bytes_loaded: int = 0
    kv_offload_disk_blocks_stored: int = 0    # the disk tier behind it: blocks written, read back
    kv_offload_disk_blocks_loaded: int = 0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """1 + accepted drafts per proposal: the tokens one speculating step yields on average."""
        if not self.spec_decode_num_drafts:
            return 0.0
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts

    def as_dict(self) -> dict:
        """Every field by name (its values are numbers and tuples: no copy needed; the engine
        takes this snapshot every step, where ``dataclasses.asdict``'s deep copy costs ~40 us)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class StepInfo:
    """What one ``step()`` did: deterministic, printable, for notebooks and tests.

    ``scheduled`` holds ``(seq_id, first_position, num_tokens)`` per sequence, ``sampled``
    ``(seq_id, token_id)``, ``preempted`` the sequences sent back to waiting, ``finished`` the
    requests handed out, ``copies`` the copy-on-write ``(src, dst)`` blocks copied before the
    forward pass, ``swap_out``/``swap_in`` the ``(src, dst)`` block copies of chapter 09's swapping
    (device to CPU, CPU to device), ``store``/``load`` those of chapter 15's tier (device block to
    tier slot, tier slot to device block). (A request's first sequence has the request's id; its
    forks have their own.)
    """

    step: int
    is_prefill: bool
    scheduled: tuple[tuple[int, int, int], ...]
    sampled: tuple[tuple[int, int], ...]
    preempted: tuple[int, ...]
    finished: tuple[int, ...]
    copies: tuple[tuple[int, int], ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    store: tuple[tuple[int, int], ...] = ()
    load: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.scheduled)

    def describe(self, names: dict[int, str] | None = None) -> str:
        def name(rid):
            return names.get(rid, f"req {rid}") if names else f"req {rid}"

        kind = "prefill" if self.is_prefill else "decode"
        parts = [f"{name(r)}[{p}:{p + n}]" for r, p, n in self.scheduled]
        n = self.num_tokens
        text = f"step {self.step} {kind} ({n} token{'' if n == 1 else 's'}): " + (", ".join(parts) or "nothing")
        if self.preempted:
            text += "; preempted " + ", ".join(name(r) for r in self.preempted)
        if self.finished:
            text += "; finished " + ", ".join(name(r) for r in self.finished)
        if self.store or self.load:
            text += f"; tier: stored {len(self.store)}, loaded {len(self.load)} block(s)"
        return text
