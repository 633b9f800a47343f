"""The LLMEngine: requests in, one scheduled forward pass per ``step()``, outputs out (chapter 06).

It wires the three parts the earlier chapters built::

    add_request(prompt) -> Sequence -> Scheduler.add       (validated: clear errors, nothing queued)
    step():  Scheduler.schedule()  -> seqs, is_prefill     (which tokens run now)
             ModelRunner.run(seqs) -> sampled tokens       (K/V written into the paged cache)
             Scheduler.postprocess -> finished sequences   (num_cached_tokens, hash_blocks, EOS)
    abort_request(request_id)                              (blocks freed, finish_reason "abort")

and keeps the numbers a serving system reports: per request the time to first token and the
tokens the prefix cache provided; for the engine the counters vLLM exports under the same
names (prefix-cache queries, hits and hit rate, KV cache usage, preemptions, tokens).

Faults. If the model or the sampler raises, the step is undone (``Scheduler.unschedule``): no
token is recorded and the same tokens are computed again by the next step. A finished
request's output is handed out exactly once, by the first ``step()`` that can build it.

Threads. One engine serves one thread at a time: a call from a second thread while another
one is inside ``step``/``generate``/``add_request``/``abort_request`` raises ``RuntimeError``
at once, instead of interleaving two callers' steps.
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from course_pkg.engine.model_runner import ModelRunner
from course_pkg.sampling_params import SamplingParams
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import Sequence
from course_pkg.validation import INT64_MAX, check_bool, check_choice, check_int, check_positive_int, check_token_ids


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
        """A token was sampled for this request at ``now``, in engine step ``step``."""
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now
        self.token_steps.append(step)

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: from arrival to the first generated token (queueing and prefill included)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``): completion ``index`` of ``n``.

    ``cumulative_logprob`` is the sum of the model's log-probabilities (``log_softmax`` of the
    raw logits) of the completion's tokens.
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str


@dataclass
class RequestOutput:
    """What ``generate`` returns per prompt (names as in vLLM's ``RequestOutput``).

    ``outputs`` holds the request's ``n`` completions in index order; ``text``, ``token_ids``
    and ``finish_reason`` are the first one's, so code written for ``n == 1`` reads them
    directly. ``num_cached_tokens`` is how many prompt tokens the prefix cache provided when the
    request was first admitted (not ``Sequence.num_cached_tokens``, which counts every token
    computed so far). A ``finish_reason`` is ``"stop"`` (end-of-sequence token), ``"length"``
    (``max_tokens`` or ``max_model_len`` reached) or ``"abort"`` (``abort_request``), as the
    Scheduler decided it.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics

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

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepInfo:
    """What one ``step()`` did: deterministic, printable, for notebooks and tests.

    ``scheduled`` holds ``(seq_id, first_position, num_tokens)`` per sequence, ``sampled``
    ``(seq_id, token_id)``, ``preempted`` the sequences sent back to waiting, ``finished`` the
    requests handed out, ``copies`` the copy-on-write ``(src, dst)`` blocks copied before the
    forward pass. (A request's first sequence has the request's id; its forks have their own.)
    """

    step: int
    is_prefill: bool
    scheduled: tuple[tuple[int, int, int], ...]
    sampled: tuple[tuple[int, int], ...]
    preempted: tuple[int, ...]
    finished: tuple[int, ...]
    copies: tuple[tuple[int, int], ...] = ()

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
        return text


class LLMEngine:
    """Offline inference engine: a model, its paged KV cache, a scheduler.

    ``model`` is a Hugging Face checkpoint folder (``None``: the tiny default shipped with the
    package). The KV cache holds ``num_kvcache_blocks`` blocks when given, else as many as
    ``kv_cache_memory_bytes`` allows (a CPU default of 256 MiB), or on a GPU what
    ``gpu_memory_utilization`` leaves after the weights and a warm-up pass.

    ``tensor_parallel_size=k > 1`` splits the model over ``k`` ranks (chapter 10,
    :mod:`course_pkg.distributed`): this process is rank 0 and keeps the one scheduler;
    ``self.model`` is then rank 0's shard, and the byte budget is per rank. Call ``close()``
    (or use ``with LLM(...) as llm:``) to stop the worker processes.

    Chapter 09's options, passed to the Scheduler: ``scheduling`` ("prefill_first" or
    "mixed"), ``preemption_mode`` ("recompute" or "swap", with ``num_cpu_blocks`` blocks of
    host memory; not with tensor parallelism) and ``same_step_prefix_hits``. The metrics are
    also kept in a Prometheus registry, ``self.metrics_registry``, under vLLM's names.
    """

    def __init__(self, model: str | Path | None = None, *, block_size: int = 16,
                 num_kvcache_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, attention_backend: str = "auto",
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 seed: int = 0, free_queue: str = "linked", tensor_parallel_size: int = 1,
                 scheduling: str = "prefill_first", preemption_mode: str = "recompute",
                 num_cpu_blocks: int | None = None, same_step_prefix_hits: bool = False):
        from course_pkg.engine.metrics import PrometheusMetrics
        from course_pkg.models import default_model_path, load_config, load_model, load_tokenizer
        from course_pkg.scheduler import SCHEDULING_POLICIES, check_preemption

        # Chapter 09's options are checked before the model loads (the Scheduler checks them too).
        check_choice("scheduling", scheduling, SCHEDULING_POLICIES)
        check_preemption(preemption_mode, num_cpu_blocks)
        check_bool("same_step_prefix_hits", same_step_prefix_hits)

        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        check_positive_int("block_size", block_size)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        check_int("seed", seed, minimum=0, maximum=INT64_MAX)
        check_positive_int("tensor_parallel_size", tensor_parallel_size)
        if preemption_mode == "swap" and tensor_parallel_size > 1:
            raise ValueError("preemption_mode='swap' is not supported with tensor_parallel_size > 1 "
                             "(every rank would have to swap its shard of the cache); use 'recompute'")
        if tensor_parallel_size == 1:
            self.model, self.config, self.tokenizer = load_model(model, dtype=dtype, device=device)
        else:       # the ranks load their own shards; rank 0 needs the config and tokenizer only
            from course_pkg.distributed import check_tensor_parallel_size
            path = default_model_path() if model is None else Path(model)
            self.config, self.tokenizer = load_config(path), load_tokenizer(path)
            check_tensor_parallel_size(tensor_parallel_size, self.config, device.type)
        limit = self.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        else:
            check_int("max_model_len", max_model_len, minimum=2, maximum=limit)
        self.max_model_len = max_model_len
        runner_kwargs = dict(
            block_size=block_size, num_kvcache_blocks=num_kvcache_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, seed=seed)
        if tensor_parallel_size == 1:
            self.model_runner = ModelRunner(self.model, self.config, **runner_kwargs,
                                            num_cpu_blocks=num_cpu_blocks if preemption_mode == "swap" else 0)
        else:
            from course_pkg.distributed import TensorParallelModelRunner
            self.model_runner = TensorParallelModelRunner.launch(
                path, self.config, tensor_parallel_size, device=device, dtype=dtype, **runner_kwargs)
            self.model = self.model_runner.model
        eos = stop_token_ids(model, self.config, self.tokenizer)
        self.scheduler = Scheduler(
            self.model_runner.num_kvcache_blocks, block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, eos_token_id=eos, free_queue=free_queue,
            scheduling=scheduling, preemption_mode=preemption_mode, num_cpu_blocks=num_cpu_blocks,
            same_step_prefix_hits=same_step_prefix_hits)
        self.block_size = block_size
        self.num_steps = 0
        self.last_step: StepInfo | None = None
        self._requests: dict[int, _Request] = {}     # every request not yet handed out
        self._ready: list[int] = []                  # requests whose every completion finished
        self._lock = threading.RLock()
        self.prometheus = PrometheusMetrics(Path(model).name if model is not None else "course-tiny")
        self.prometheus.update(self.get_metrics())

    @property
    def metrics_registry(self):
        """The ``prometheus_client.CollectorRegistry`` with this engine's metrics (vLLM's names)."""
        return self.prometheus.registry

    @contextmanager
    def _exclusive(self):
        """Hold the engine for this thread; another thread gets a RuntimeError at once."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this engine is in use by another thread (step, generate, add_request or "
                               "abort_request are running there); an engine serves one thread at a time")
        try:
            yield
        finally:
            self._lock.release()

    def close(self) -> None:
        """Release what outlives a Python reference: the tensor-parallel worker processes."""
        close = getattr(self.model_runner, "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- requests

    @property
    def block_manager(self):
        return self.scheduler.block_manager

    def make_sequence(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> Sequence:
        """A Sequence for ``prompt`` (text or token ids), its tokens checked; queues nothing.

        Raises ``ValueError`` naming the problem: an empty prompt, a token id outside the
        vocabulary (also for text, whose tokenizer may know more tokens than the model).
        ``Scheduler.add`` checks the rest (a prompt of ``max_model_len`` tokens or more, a
        request that can never fit in the KV cache); ``SamplingParams`` check their own fields.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompts as token ids")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            if not token_ids:
                raise ValueError(f"prompt {prompt!r} is empty: it encodes to no tokens")
            check_token_ids(f"the token ids of prompt {prompt!r}", token_ids, self.config.vocab_size)
        else:
            token_ids = list(prompt)
            if not token_ids:
                raise ValueError("prompt is empty: a request needs at least one token")
            check_token_ids("prompt", token_ids, self.config.vocab_size)
        return Sequence(token_ids, sampling_params, block_size=self.block_size)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Raises (and queues nothing) if it is invalid."""
        with self._exclusive():
            return self._add_all([self.make_sequence(prompt, sampling_params)], [prompt])[0]

    def _add_all(self, seqs: list[Sequence], prompts: list) -> list[int]:
        self.scheduler.add_all(seqs)   # checks every one first; queues all or none
        now = time.perf_counter()
        for seq, prompt in zip(seqs, prompts):
            self._requests[seq.seq_id] = _Request(seq, prompt if isinstance(prompt, str) else None,
                                                  RequestMetrics(arrival_time=now, arrival_step=self.num_steps))
        self.prometheus.update(self.get_metrics())
        return [seq.seq_id for seq in seqs]

    def abort_request(self, request_id: int) -> RequestOutput:
        """Stop a request now, free its blocks, and return its output (``finish_reason="abort"``).

        A request that has already finished, but whose output no ``step()`` handed out yet,
        is returned as it finished. Raises ``KeyError`` for an unknown or handed-out request.
        """
        with self._exclusive():
            if request_id not in self._requests:
                raise KeyError(f"no unfinished request with id {request_id}")
            if request_id not in self._ready:
                for seq in self._completions(request_id):
                    if self.scheduler.holds(seq):
                        self.scheduler.abort(seq)
            out = self._make_output(request_id)   # if this raises, a second call returns it
            if request_id in self._ready:
                self._ready.remove(request_id)
            del self._requests[request_id]
            self._observe_finished([out])
            return out

    def _completions(self, request_id: int) -> list[Sequence]:
        """The sequences of a request: its own, then its forks (completions 1 .. n-1)."""
        seq = self._requests[request_id].seq
        return [seq] + seq.children

    def get_sequence(self, request_id: int) -> Sequence:
        """The live Sequence of an unfinished request (to watch its block table)."""
        if request_id not in self._requests:
            raise KeyError(f"no unfinished request with id {request_id}")
        return self._requests[request_id].seq

    def has_unfinished_requests(self) -> bool:
        """True while some request's output has not been handed out by ``step()``."""
        return bool(self._requests)

    def is_finished(self) -> bool:
        return not self.has_unfinished_requests()

    # ---------------------------------------------------------------- one step

    def step(self) -> list[RequestOutput]:
        """Schedule, run and postprocess one step; return the requests that finished in it."""
        with self._exclusive():
            seqs, is_prefill = self.scheduler.schedule()
            scheduled = tuple((s.seq_id, s.num_cached_tokens, s.num_scheduled_tokens) for s in seqs)
            preempted = tuple(s.seq_id for s in self.scheduler.preempted)
            copies = tuple(self.scheduler.blocks_to_copy)
            self._note_scheduled(seqs, preempted, time.perf_counter())
            token_ids, finished = self._run(seqs, copies)
            self._note_tokens(seqs, token_ids, time.perf_counter())
            outputs = self._hand_out(finished)
            self.last_step = StepInfo(
                step=self.num_steps, is_prefill=is_prefill, scheduled=scheduled,
                sampled=tuple((s.seq_id, t) for s, t in zip(seqs, token_ids) if t is not None),
                preempted=preempted, finished=tuple(out.request_id for out in outputs), copies=copies)
            self.num_steps += 1
            self._observe_finished(outputs)
            return outputs

    def _run(self, seqs: list[Sequence], copies: tuple[tuple[int, int], ...]):
        """The step's block copies, its forward pass and its bookkeeping: ``(tokens, finished)``.

        If any of it raises, ``unschedule`` undoes the step (nothing was recorded) and the next
        step computes the same tokens again. The copies come first, every read of a block
        before any write into it: a block freed by a preemption in this step may already be a
        copy's or a swap-in's destination (chapter 09).
        """
        runner = self.model_runner
        try:
            runner.swap_out(self.scheduler.blocks_to_swap_out)
            runner.copy_blocks(list(copies))   # copy-on-write, before the forward pass
            runner.swap_in(self.scheduler.blocks_to_swap_in)
            token_ids, logprobs = runner.run_with_logprobs(seqs)
            return token_ids, self.scheduler.postprocess(seqs, token_ids, logprobs)
        except BaseException:
            self.scheduler.unschedule(seqs)
            raise

    def _note_tokens(self, seqs: list[Sequence], token_ids: list, now: float) -> None:
        sampled_requests = set()   # a request's completions sample together: one token time per step
        for seq, token in zip(seqs, token_ids):
            if token is None or seq.request_id in sampled_requests:
                continue
            sampled_requests.add(seq.request_id)
            metrics = self._requests[seq.request_id].metrics
            first = metrics.first_token_time is None
            metrics.record_token(now, self.num_steps)
            self.prometheus.observe_token(metrics.time_to_first_token if first else None,
                                          None if first else metrics.inter_token_latencies[-1])

    def _hand_out(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests whose every completion has finished, each exactly once.

        Every output is built before any is handed out: if the tokenizer raises, they all stay
        pending and the next step hands them out.
        """
        for seq in finished:
            rid = seq.request_id
            if rid not in self._ready and all(s.is_finished for s in self._completions(rid)):
                self._ready.append(rid)
        outputs = [self._make_output(rid) for rid in self._ready]
        for rid in self._ready:
            del self._requests[rid]
        self._ready = []
        return outputs

    def _observe_finished(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.prometheus.observe_finished(out.metrics.e2e_latency, out.metrics.queue_time)
        self.prometheus.update(self.get_metrics())

    def _note_scheduled(self, seqs: list[Sequence], preempted: tuple[int, ...], now: float) -> None:
        for seq in self.scheduler.preempted:
            self._requests[seq.request_id].metrics.num_preemptions += 1
        for seq in seqs:
            req = self._requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.num_cached_tokens = seq.num_cached_tokens   # the prefix-cache hit at admission

    def _make_output(self, request_id: int) -> RequestOutput:
        req = self._requests[request_id]
        if req.metrics.finished_time is None:
            req.metrics.finished_time = time.perf_counter()
        outputs = []
        for seq in self._completions(request_id):
            tokens = seq.completion_token_ids
            text = None if self.tokenizer is None else self.tokenizer.decode(tokens, skip_special_tokens=True)
            outputs.append(CompletionOutput(index=seq.index, text=text, token_ids=tokens,
                                            cumulative_logprob=seq.cumulative_logprob,
                                            finish_reason=seq.finish_reason or "abort"))
        return RequestOutput(request_id=request_id, prompt=req.prompt, prompt_token_ids=req.seq.prompt_token_ids,
                             outputs=outputs, num_cached_tokens=req.num_cached_tokens, metrics=req.metrics)

    # ---------------------------------------------------------------- metrics

    def get_metrics(self) -> EngineMetrics:
        sched, bm = self.scheduler, self.scheduler.block_manager
        stats, cache = sched.stats, bm.prefix_cache_stats
        return EngineMetrics(
            num_requests_running=len(sched.running), num_requests_waiting=len(sched.waiting),
            num_kvcache_blocks=bm.num_blocks, kv_cache_usage_perc=bm.kv_cache_usage,
            prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits,
            prefix_cache_hit_rate=cache.hit_rate, num_preemptions=stats.num_preemptions,
            prompt_tokens=stats.prompt_tokens, generation_tokens=stats.generation_tokens,
            prefill_kv_computed_tokens=stats.prefill_kv_computed_tokens,
            num_prefill_steps=stats.num_prefill_steps, num_decode_steps=stats.num_decode_steps,
            num_mixed_steps=stats.num_mixed_steps, num_swapped_out=stats.num_swapped_out,
            num_swapped_in=stats.num_swapped_in, num_swap_fallbacks=stats.num_swap_fallbacks,
            cpu_kv_cache_usage_perc=sched.cpu_pool.usage if sched.cpu_pool is not None else 0.0)


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def stop_token_ids(model_path, config, tokenizer) -> list[int]:
    """End-of-sequence ids: the config's, the checkpoint's ``generation_config.json``'s (chat
    models such as Qwen3 list several there), else the tokenizer's."""
    from course_pkg.models import default_model_path

    ids = _as_ids(config.eos_token_id)
    gen_file = Path(default_model_path() if model_path is None else model_path) / "generation_config.json"
    if gen_file.is_file():
        ids += _as_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
    if not ids and tokenizer is not None:
        ids = _as_ids(tokenizer.eos_token_id)
    return sorted(set(ids))


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    metrics: RequestMetrics
    num_cached_tokens: int = field(default=0)
