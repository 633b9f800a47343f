"""The LLMEngine: requests in, one scheduled forward pass per ``step()``, outputs out (chapter 06).

It wires the three parts the earlier chapters built::

    add_request(prompt) -> Sequence -> Scheduler.add       (validated: clear errors, nothing queued)
    step():  Scheduler.schedule()  -> seqs, is_prefill     (which tokens run now)
             ModelRunner.run(seqs) -> sampled tokens       (K/V written into the paged cache)
             Scheduler.postprocess -> finished sequences   (num_cached_tokens, hash_blocks, EOS)

and keeps the numbers a serving system reports: per request the time to first token and the
tokens the prefix cache provided; for the engine the counters vLLM exports under the same
names (prefix-cache queries, hits and hit rate, KV cache usage, preemptions, tokens).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from course_pkg.engine.model_runner import ModelRunner
from course_pkg.sampling_params import SamplingParams
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import Sequence


@dataclass
class RequestMetrics:
    """Times (``time.perf_counter`` seconds) in the life of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: from arrival to the first generated token (queueing and prefill included)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """What ``generate`` returns per prompt (names as in vLLM's ``RequestOutput``).

    ``num_cached_tokens`` is how many prompt tokens the prefix cache provided when the
    request was first admitted. ``finish_reason`` is ``"stop"`` (end-of-sequence token) or
    ``"length"`` (``max_tokens`` or ``max_model_len`` reached).
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    metrics: RequestMetrics

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

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepInfo:
    """What one ``step()`` did: deterministic, printable, for notebooks and tests.

    ``scheduled`` holds ``(request_id, first_position, num_tokens)`` per sequence,
    ``sampled`` ``(request_id, token_id)``, ``preempted`` the requests sent back to waiting.
    """

    step: int
    is_prefill: bool
    scheduled: tuple[tuple[int, int, int], ...]
    sampled: tuple[tuple[int, int], ...]
    preempted: tuple[int, ...]
    finished: tuple[int, ...]

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
    """

    def __init__(self, model: str | Path | None = None, *, block_size: int = 16,
                 num_kvcache_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, attention_backend: str = "auto",
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 seed: int = 0, free_queue: str = "deque", tensor_parallel_size: int = 1):
        from course_pkg.distributed import check_tensor_parallel_size
        from course_pkg.models import default_model_path, load_config, load_model, load_tokenizer

        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if tensor_parallel_size == 1:
            self.model, self.config, self.tokenizer = load_model(model, dtype=dtype, device=device)
            check_tensor_parallel_size(tensor_parallel_size, self.config, device.type)   # 1, not 1.0 or True
        else:       # the ranks load their own shards; rank 0 needs the config and tokenizer only
            path = default_model_path() if model is None else Path(model)
            self.config, self.tokenizer = load_config(path), load_tokenizer(path)
            check_tensor_parallel_size(tensor_parallel_size, self.config, device.type)
        limit = self.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        elif not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be an integer in [2, {limit}] "
                             f"(the model's max_position_embeddings), got {max_model_len!r}")
        self.max_model_len = max_model_len
        runner_kwargs = dict(
            block_size=block_size, num_kvcache_blocks=num_kvcache_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
            attention_backend=attention_backend, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, seed=seed)
        if tensor_parallel_size == 1:
            self.model_runner = ModelRunner(self.model, self.config, **runner_kwargs)
        else:
            from course_pkg.distributed import TensorParallelModelRunner
            self.model_runner = TensorParallelModelRunner.launch(
                path, self.config, tensor_parallel_size, device=device, dtype=dtype, **runner_kwargs)
            self.model = self.model_runner.model
        eos = stop_token_ids(model, self.config, self.tokenizer)
        self.scheduler = Scheduler(
            self.model_runner.num_kvcache_blocks, block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, eos_token_id=eos, free_queue=free_queue)
        self.block_size = block_size
        self.num_steps = 0
        self.last_step: StepInfo | None = None
        self._requests: dict[int, _Request] = {}

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
        """A validated Sequence for ``prompt`` (text or token ids); queues nothing.

        Raises ``ValueError`` naming the problem: an empty prompt, a token id outside the
        vocabulary, a prompt of ``max_model_len`` tokens or more, a request that can never fit
        in the KV cache. ``SamplingParams`` check their own fields when they are created.
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
        else:
            token_ids = list(prompt)
            if not token_ids:
                raise ValueError("prompt is empty: a request needs at least one token")
            vocab = self.config.vocab_size
            for i, t in enumerate(token_ids):
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"prompt token {i} is {t!r}: token ids must be integers in "
                                     f"[0, {vocab}) (the model's vocabulary)")
        seq = Sequence(token_ids, sampling_params, block_size=self.block_size)
        self.scheduler.check(seq)
        return seq

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Raises (and queues nothing) if it is invalid."""
        return self._add(self.make_sequence(prompt, sampling_params), prompt)

    def _add(self, seq: Sequence, prompt) -> int:
        self.scheduler.add(seq)
        self._requests[seq.seq_id] = _Request(seq, prompt if isinstance(prompt, str) else None,
                                              RequestMetrics(arrival_time=time.perf_counter()))
        return seq.seq_id

    def get_sequence(self, request_id: int) -> Sequence:
        """The live Sequence of an unfinished request (to watch its block table)."""
        if request_id not in self._requests:
            raise KeyError(f"no unfinished request with id {request_id}")
        return self._requests[request_id].seq

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    # ---------------------------------------------------------------- one step

    def step(self) -> list[RequestOutput]:
        """Schedule, run and postprocess one step; return the requests that finished in it."""
        seqs, is_prefill = self.scheduler.schedule()
        now = time.perf_counter()
        preempted = tuple(s.seq_id for s in self.scheduler.preempted)
        for rid in preempted:
            self._requests[rid].metrics.num_preemptions += 1
        scheduled = tuple((s.seq_id, s.num_cached_tokens, s.num_scheduled_tokens) for s in seqs)
        for seq in seqs:
            req = self._requests[seq.seq_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.num_cached_tokens = seq.num_cached_tokens  # the prefix-cache hit at admission
        token_ids = self.model_runner.run(seqs)
        finished = self.scheduler.postprocess(seqs, token_ids)
        now = time.perf_counter()
        for seq, token in zip(seqs, token_ids):
            if token is not None and self._requests[seq.seq_id].metrics.first_token_time is None:
                self._requests[seq.seq_id].metrics.first_token_time = now
        outputs = [self._finish(seq, now) for seq in finished]
        self.last_step = StepInfo(
            step=self.num_steps, is_prefill=is_prefill, scheduled=scheduled,
            sampled=tuple((s.seq_id, t) for s, t in zip(seqs, token_ids) if t is not None),
            preempted=preempted, finished=tuple(s.seq_id for s in finished))
        self.num_steps += 1
        return outputs

    def _finish(self, seq: Sequence, now: float) -> RequestOutput:
        req = self._requests.pop(seq.seq_id)
        req.metrics.finished_time = now
        last = seq.token_ids[-1]
        reason = "stop" if (not seq.ignore_eos and last in self.scheduler.eos_token_ids) else "length"
        tokens = seq.completion_token_ids
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return RequestOutput(request_id=seq.seq_id, prompt=req.prompt, prompt_token_ids=seq.prompt_token_ids,
                             text=text, token_ids=tokens, finish_reason=reason,
                             num_cached_tokens=req.num_cached_tokens, metrics=req.metrics)

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
            num_prefill_steps=stats.num_prefill_steps, num_decode_steps=stats.num_decode_steps)


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
